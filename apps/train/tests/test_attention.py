"""A module's group attention (``model.compile`` sets it) is what its packed rows run."""

import torch

from batching import sdpa_causal_attention, varlen_layout
from klppo_train.runtime.packed_attention import GROUP_ATTENTION


def test_a_modules_group_attention_is_what_its_packed_rows_run() -> None:
    from klppo_train.demo.embedded import build_model

    model = build_model(64, seed=0, hidden=64).eval()
    model.set_attn_implementation("klppo_varlen")
    ids = torch.randint(3, 64, (1, 30))
    layout = varlen_layout(torch.tensor([0, 12, 30], dtype=torch.int32))  # 12 and 18: 2 groups
    with torch.no_grad():
        want = model(input_ids=ids, packed_layout=layout, use_cache=False).logits
        calls = []

        def counting(q, k, v, scale):
            calls.append(q.shape)
            return sdpa_causal_attention(q, k, v, scale)

        layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        for module in layers:
            setattr(module, GROUP_ATTENTION, counting)
        got = model(input_ids=ids, packed_layout=layout, use_cache=False).logits
    assert len(calls) == 2 * len(layers) > 0
    assert torch.equal(got, want)
