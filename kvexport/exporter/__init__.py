"""Export: a Hugging Face decoder to a kvexport artifact (pipeline.py), one subpackage per target."""

# Exports run with this hash seed (kvexport export, kvexport.export and each matrix row re-run
# themselves under it). transformers builds some graphs by iterating over a set of strings (Gemma 3
# computes its rotary tables per layer type in `set(config.layer_types)` order), and that order
# follows Python's per-process hash seed: the traced program, and so the bytes of the artifact,
# would differ from one run to the next.
EXPORT_HASH_SEED = "0"
