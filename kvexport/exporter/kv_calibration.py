"""The text a target whose int8 KV cache has fixed scales measures them on (``--kv-cache int8``
on ONNX: ``onnx/quantized_kv_cache.py``), and its tokens."""

from __future__ import annotations

# A short text of several kinds (prose, dialogue, a list, code, numbers, other languages), so that
# the keys and values it gives span those of most prompts.
CALIBRATION_TEXT = """\
The lighthouse keeper wrote in her log every evening: the wind from the north-west, the sea rough,
two fishing boats back before dark, the lamp lit at 17:42. Nothing else happened, and she was glad.

"Can you tell me how to get to the station?" asked the traveller.
"Go straight on, turn left at the bakery, and it's the red building after the bridge."
"Thank you! Is it far?" "About ten minutes on foot, less if you hurry."

Shopping list: 2 kg of flour, 6 eggs, 500 ml of milk, butter, a lemon, salt, 3 apples.

def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

for i in range(10):
    print(i, i ** 2, mean([i, i + 1.5]))

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id)
WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 5;

Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2.
The speed of light is about 299,792 km/s; the Earth is 149.6 million km from the Sun, so sunlight
takes roughly 8 minutes and 20 seconds to reach us.

Le chat dort sur le canapé. Der Zug fährt um acht Uhr ab. El niño lee un libro en la biblioteca.
東京は日本の首都です。 Москва — столица России. 1 + 1 = 2, 3 × 7 = 21, √144 = 12, π ≈ 3.14159.

Q: What is the capital of Australia? A: Canberra.
Q: Summarise the story in one sentence. A: A keeper watches the sea, and a quiet day is a good one.
"""


def calibration_ids(tokenizer):
    """The calibration text as the runners tokenize a prompt (special tokens included): ``[1, N]``
    int64. (torch is imported here: the CLI imports this module before it loads a model.)"""
    import torch

    return torch.tensor([tokenizer(CALIBRATION_TEXT)["input_ids"]], dtype=torch.long)
