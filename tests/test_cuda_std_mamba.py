"""The GPU training step of std Mamba (std/models/mamba.module) against transformers'
MambaForCausalLM (`-m cuda`; skipped without CUDA): one bf16 step's loss within 1e-2 of
transformers' fp32 run on the same weights and batch, and every parameter gradient
within tests/bf16_parity.py's bounds (cosine >= 0.999 with the fp32 gradients, or no
further from them than 2x transformers' own bf16 run). T = 300 spans three scan tiles and,
with chunk_size 128, three backward chunks; the step runs the CUDA kernels of
mamba_conv1d and mamba_selective_scan (counted), not the reference loop."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.bf16_parity import (  # noqa: E402
    far_gradients, fp32_and_bf16, hf_loss_and_gradients, step_gradients, tiny_hf_checkpoint,
)
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

B, T, VOCAB = 2, 300, 512
MODULE = "std/models/mamba.module"
CASES = {  # name: (HF config, our settings)
    "tied": (dict(hidden_size=256, num_hidden_layers=2, state_size=16, expand=2,
                  conv_kernel=4),
             dict(d_model=256, n_layers=2, d_state=16, expand=2, d_conv=4, chunk_size=128)),
    "untied-rank": (dict(hidden_size=128, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=3, time_step_rank=12, tie_word_embeddings=False),
                    dict(d_model=128, n_layers=2, d_state=8, expand=2, d_conv=3, dt_rank=12,
                         tie_word_embeddings="false")),
}


class _Counting:
    """The extension with a count of each Mamba kernel's calls."""

    def __init__(self, extension):
        self.extension, self.calls = extension, {}

    def __getattr__(self, name):
        fn = getattr(self.extension, name)
        if not name.startswith("mamba_"):
            return fn

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_step_matches_transformers(name, tmp_path, monkeypatch):
    from runtime.cuda import mamba

    config, settings = CASES[name]
    model = tiny_hf_checkpoint(tmp_path, "MambaConfig", "MambaForCausalLM", attention=None,
                               vocab_size=VOCAB, **config)
    hf32, hf = fp32_and_bf16(model)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(7),
                           dtype=torch.int32)
    counting = _Counting(mamba._extension())
    monkeypatch.setattr(mamba, "_extension", lambda: counting)
    loss, ours = step_gradients(MODULE, dict(settings, vocab_size=VOCAB), tmp_path, tokens)
    layers = config["num_hidden_layers"]
    assert {k: v >= layers for k, v in counting.calls.items()} == {
        "mamba_conv1d_forward": True, "mamba_conv1d_backward": True,
        "mamba_scan_forward": True, "mamba_scan_backward": True}, counting.calls
    _, bf16 = hf_loss_and_gradients(hf, tokens)
    fp32_loss, fp32 = hf_loss_and_gradients(hf32, tokens)
    assert abs(loss - fp32_loss) / fp32_loss < 1e-2, (loss, fp32_loss)
    assert ours.keys() == fp32.keys()
    assert not far_gradients(ours, bf16, fp32)
