"""Where ZeRO's weight all-gathers run (runtime/dist/ce_gather.py): on the copy engines
only where NCCL >= 2.28 on CUDA can run them so (zero-CTA policy, symmetric window), for
ZeRO-1/2 over the whole world; otherwise on SMs, with the reason said (`refusal`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from runtime.dist import ce_gather  # noqa: E402


@pytest.fixture
def nccl_world(monkeypatch):
    """An initialized NCCL world of two ranks with NCCL 2.28.9 and the CTA option, faked:
    the decision reads only these."""
    monkeypatch.delenv("MODULEC_ZERO_CE_GATHER", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is None else
                        group)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))

    class Options:
        NCCL_CTA_POLICY_ZERO = 2
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Options, raising=False)
    return monkeypatch


def test_zero_1_and_2_over_the_world_gather_on_copy_engines(nccl_world):
    assert ce_gather.refusal("cuda", None, 2) is None
    assert ce_gather.refusal("cuda:1", None, 1) is None


@pytest.mark.parametrize("change, zero, why", [
    (lambda m: m.setenv("MODULEC_ZERO_CE_GATHER", "0"), 2, "MODULEC_ZERO_CE_GATHER=0"),
    (lambda m: None, 3, "ZeRO-3 gathers into slots"),
    (lambda m: None, 0, "ZeRO-0 gathers nothing"),
    (lambda m: m.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3)), 2,
     "NCCL 2.27 (copy-engine collectives need 2.28)"),
    (lambda m: m.setattr(dist, "get_backend", lambda group=None: "gloo"), 2,
     "not NCCL on CUDA"),
    (lambda m: m.delattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"), 2,
     "this torch has no NCCL CTA policy option"),
    (lambda m: m.setenv("LOCAL_WORLD_SIZE", "1"), 2,
     "ranks on several nodes (copy-engine gathers need one NVLink domain)"),
])
def test_what_keeps_the_gathers_on_sms_is_said(nccl_world, change, zero, why):
    change(nccl_world)
    assert ce_gather.refusal("cuda", None, zero) == why


def test_a_data_parallel_group_beside_tensor_parallel_stays_on_sms(nccl_world):
    """get_world_size(group) is faked as the group itself: a group of 1 in a world of 2."""
    assert ce_gather.refusal("cuda", 1, 2) == "the data-parallel group is narrower than " \
        "the world"


def test_the_cpu_run_says_so_without_asking_torch_distributed():
    gather, transport = ce_gather.copy_engine_gather("cpu", None, 2)
    assert gather is None and transport == "SMs: not NCCL on CUDA"
    assert ce_gather.window_bytes() == 0


def test_windows_outside_torchs_statistics_are_counted_while_they_live(monkeypatch):
    """`window_bytes` is what torch's allocator statistics miss: a window whose
    allocation did not move `torch.cuda.memory_allocated` counts until it is freed."""
    import types

    gather = object.__new__(ce_gather.CopyEngineGather)
    gather.group = types.SimpleNamespace(group_name="twin")
    gather.symm_mem = types.SimpleNamespace(
        empty=lambda numel, dtype, device: torch.empty(numel, dtype=dtype),
        rendezvous=lambda tensor, group: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    window = gather.empty(1024, torch.bfloat16, "cuda")
    assert ce_gather.window_bytes() == 2048
    del window
    assert ce_gather.window_bytes() == 0


def test_the_trainer_says_where_the_gathers_ran(monkeypatch):
    """After the first GPU step `modulec train` prints the gathers' transport (ZeRO 1-2)."""
    import types

    from runtime.train.run import Run

    notes = []
    zero = types.SimpleNamespace(zero=2, gather_transport="SMs: NCCL 2.27 (copy-engine "
                                 "collectives need 2.28)")
    fake = types.SimpleNamespace(
        trainer=types.SimpleNamespace(step=types.SimpleNamespace(zero=zero)),
        request=types.SimpleNamespace(device="cuda"))
    Run._attention_note(fake, types.SimpleNamespace(note=notes.append))
    assert notes[-1] == "ZeRO's weight all-gathers run on SMs: NCCL 2.27 (copy-engine " \
        "collectives need 2.28)"


def test_nccl_is_chosen_for_symmetric_memory_once_a_process(monkeypatch):
    """Two steps in one process (an A/B) make two twin communicators; symmetric memory's
    backend is set once, before the first window."""
    import types

    chosen = []
    fake = types.SimpleNamespace(set_backend=chosen.append)
    monkeypatch.setattr(ce_gather, "_backend_set", False)
    ce_gather._nccl_windows(fake)
    ce_gather._nccl_windows(fake)
    assert chosen == ["NCCL"]
