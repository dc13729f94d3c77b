"""Groundwork for issue 36 (onnxruntime-genai), not part of kvexport: kvexport does not install
onnxruntime-genai and no test runs this. A hand-built 4-layer GroupQueryAttention decoder (layers 0-2
sliding, window 6, with ``sliding_window_cache=1``; layer 3 full), vocabulary 100, 2 query and 2 KV
heads, head_dim 16, max_length 64, written with a ``genai_config.json`` and generated greedily by
``og.Model``; every step's logits are compared with a numpy reference with transformers' window
(query i sees keys i - W < j <= i).

Run (onnxruntime-genai 0.18.0 unpacked from its wheel, over kvexport's onnxruntime 1.31.0):
    pip download onnxruntime-genai==0.18.0 --no-deps -d /tmp/og && unzip -q /tmp/og/*.whl -d /tmp/og/wheel
    PYTHONPATH=/tmp/og/wheel .venv/bin/python scripts/experiments/genai_sliding_window_toy.py OUT 6 1 1 1

What it showed (CPU): with the arguments above, exact to length 64 (max |logit diff| 1e-6; sliding
buffers [1, 2, 22, 16] = window + the CPU's default slack of 16, full ones [1, 2, 64, 16]); with
SECTION=4 (cache_slack 3) exact with 9-row buffers; the configurations that fail and why are in
the closing note of the stop that added this file.

Arguments: OUTDIR LWS SWC SHARE SECTION
  LWS     = local_window_size attribute of the sliding layers (6: transformers' window; 5 and 7 differ)
  SWC     = sliding_window_cache attribute (0/1) of the sliding layers
  SHARE   = search.past_present_share_buffer (0/1)
  SECTION = genai_config.json's sliding_window section: 0 none, 1 as the builder writes it, 2 without
            its layers list, 3 without the slide_* flags, 4 with cache_slack 3
"""
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

out_dir, LWS, SWC, SHARE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
SECTION = int(sys.argv[5]) if len(sys.argv) > 5 else 1
os.makedirs(out_dir, exist_ok=True)

V, H, NH, NKV, D, L, W, MAXLEN = 100, 32, 2, 2, 16, 4, 6, 64
SLIDING = [0, 1, 2]
rng = np.random.default_rng(0)
emb = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
Wq = [rng.standard_normal((H, NH * D)).astype(np.float32) * 0.15 for _ in range(L)]
Wk = [rng.standard_normal((H, NKV * D)).astype(np.float32) * 0.15 for _ in range(L)]
Wv = [rng.standard_normal((H, NKV * D)).astype(np.float32) * 0.15 for _ in range(L)]
Wo = [rng.standard_normal((NH * D, H)).astype(np.float32) * 0.15 for _ in range(L)]
Wlm = (rng.standard_normal((H, V)) * 0.3).astype(np.float32)
inv_freq = 1.0 / (10000 ** (np.arange(0, D, 2, dtype=np.float32) / D))
t = np.arange(MAXLEN, dtype=np.float32)
freqs = np.outer(t, inv_freq)
cos_cache, sin_cache = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)

inits = [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(Wlm, "lm_head"),
         numpy_helper.from_array(cos_cache, "cos_cache"), numpy_helper.from_array(sin_cache, "sin_cache"),
         numpy_helper.from_array(np.array([1], np.int64), "one_1d"),
         numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
nodes = []
inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
          helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", V])]
# seqlens_k = ReduceSum(mask) - 1 (int32); total_seq_len = Shape(mask)[1] (int32 scalar)
nodes += [helper.make_node("ReduceSum", ["attention_mask", "one_1d"], ["rs"], keepdims=0),
          helper.make_node("Sub", ["rs", "one_scalar"], ["rs1"]),
          helper.make_node("Cast", ["rs1"], ["seqlens_k"], to=TensorProto.INT32),
          helper.make_node("Shape", ["attention_mask"], ["mshape"]),
          helper.make_node("Gather", ["mshape", "one_scalar"], ["tsl64"], axis=0),
          helper.make_node("Cast", ["tsl64"], ["total_seq_len"], to=TensorProto.INT32),
          helper.make_node("Gather", ["emb", "input_ids"], ["x0"], axis=0)]
x = "x0"
for i in range(L):
    for n, w in (("q", Wq[i]), ("k", Wk[i]), ("v", Wv[i]), ("o", Wo[i])):
        inits.append(numpy_helper.from_array(w, f"W{n}{i}"))
    nodes += [helper.make_node("MatMul", [x, f"Wq{i}"], [f"q{i}"]),
              helper.make_node("MatMul", [x, f"Wk{i}"], [f"k{i}"]),
              helper.make_node("MatMul", [x, f"Wv{i}"], [f"v{i}"])]
    sliding = i in SLIDING
    seq_in = "past_sliding_length" if sliding else "past_sequence_length"
    seq_out = "total_sliding_length" if sliding else "total_sequence_length"
    for kv in ("key", "value"):
        inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT, ["batch_size", NKV, seq_in, D]))
        outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT, ["batch_size", NKV, seq_out, D]))
    attrs = dict(num_heads=NH, kv_num_heads=NKV, do_rotary=1, rotary_interleaved=0, scale=1.0 / np.sqrt(D),
                 local_window_size=LWS if sliding else -1, softcap=0.0)
    if sliding and SWC:
        attrs["sliding_window_cache"] = 1
    nodes.append(helper.make_node(
        "GroupQueryAttention",
        [f"q{i}", f"k{i}", f"v{i}", f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
         "total_seq_len", "cos_cache", "sin_cache"],
        [f"a{i}", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft", name=f"gqa{i}", **attrs))
    nodes += [helper.make_node("MatMul", [f"a{i}", f"Wo{i}"], [f"o{i}"]),
              helper.make_node("Add", [x, f"o{i}"], [f"x{i + 1}"])]
    x = f"x{i + 1}"
nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"]))
graph = helper.make_graph(nodes, "tiny", inputs, outputs, inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
model.ir_version = 10
onnx.save(model, os.path.join(out_dir, "model.onnx"))

cfg = {
    "model": {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "context_length": MAXLEN, "vocab_size": V,
        "type": "decoder",
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "filename": "model.onnx", "head_size": D, "hidden_size": H,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
            "num_attention_heads": NH, "num_hidden_layers": L, "num_key_value_heads": NKV,
        },
    },
    "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
               "max_length": MAXLEN, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
               "num_return_sequences": 1, "past_present_share_buffer": bool(SHARE), "repetition_penalty": 1.0,
               "temperature": 1.0, "top_k": 1, "top_p": 1.0},
}
if SECTION:
    sw = {"window_size": W, "slide_key_value_cache": False, "slide_inputs": False, "layers": SLIDING, "cache_slack": 0}
    if SECTION == 2:
        del sw["layers"]
    if SECTION == 3:
        del sw["slide_key_value_cache"], sw["slide_inputs"]
    if SECTION == 4:
        sw["cache_slack"] = 3
    cfg["model"]["decoder"]["sliding_window"] = sw
with open(os.path.join(out_dir, "genai_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


# ---- numpy reference (HF semantics: window W keys including the current one) ----
def rope(xh, pos):
    c, s = cos_cache[pos][:, None, :], sin_cache[pos][:, None, :]
    x1, x2 = xh[..., : D // 2], xh[..., D // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def ref_logits(tokens, window):
    n = len(tokens)
    pos = np.arange(n)
    h = emb[np.array(tokens)]
    for i in range(L):
        q = rope((h @ Wq[i]).reshape(n, NH, D), pos)
        k = rope((h @ Wk[i]).reshape(n, NKV, D), pos)
        v = (h @ Wv[i]).reshape(n, NKV, D)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        qi, kj = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        allowed = kj <= qi
        if i in SLIDING:
            allowed &= (qi - kj) < window
        sc = np.where(allowed[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", p, v).reshape(n, NH * D)
        h = h + a @ Wo[i]
    return h @ Wlm


prompt = [5, 17, 33, 8, 91, 42, 7, 64, 23, 11]  # 10 tokens > W
import onnxruntime_genai as og  # noqa: E402

m = og.Model(out_dir)
params = og.GeneratorParams(m)
params.set_search_options(max_length=MAXLEN, min_length=MAXLEN, do_sample=False, top_k=1)
g = og.Generator(m, params)
g.append_tokens(prompt)
seq = list(prompt)
max_err = {"hfW": 0.0, "hfW+1": 0.0}
first_div = {"hfW": None, "hfW+1": None}
steps = 0
while not g.is_done():
    g.generate_next_token()
    lg = np.array(g.get_output("logits"))[0, -1]  # logits of the run that produced this token (on `seq`)
    tok = int(g.get_next_tokens()[0])
    for name, win in (("hfW", W), ("hfW+1", W + 1)):
        r = ref_logits(seq, win)[-1]
        keep = np.arange(V) != 2  # min_length writes -FLT_MAX into the EOS logit in place
        e = float(np.abs(r - lg)[keep].max())
        max_err[name] = max(max_err[name], e)
        if e > 1e-3 and first_div[name] is None:
            first_div[name] = len(seq)
    assert tok == int(np.argmax(lg)), "sampled token is not argmax of read logits"
    seq.append(tok)
    steps += 1
print(json.dumps({"LWS": LWS, "SWC": SWC, "SHARE": SHARE, "SECTION": SECTION, "final_len": len(seq), "steps": steps,
                  "max_abs_err_vs_ref_window_W": max_err["hfW"],
                  "first_len_diverging_W": first_div["hfW"],
                  "max_abs_err_vs_ref_window_W_plus_1": max_err["hfW+1"],
                  "first_len_diverging_W_plus_1": first_div["hfW+1"]}))
