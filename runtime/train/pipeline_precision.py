"""How a pipeline stage holds, computes with and steps its parameters.

On the GPU a stage trains as the one-GPU trainer does (runtime/cuda/step.py): the kernels
of the GPU step's registry (runtime.cuda.train_kernels: cuDNN attention, the fused norms,
SwiGLU and RoPE) read bf16 compute copies of the weights, the boundary tensors travel in
bf16, each micro-batch's parameter gradients are summed in fp32, and AdamW steps fp32
masters, whose bf16 copies the next forward reads. On the CPU (the gloo tests) a stage
computes in the model's dtype through the reference kernels and its parameters are their
own masters: one process's arithmetic, bit for bit.

`mixed` chooses between the two; the trainer takes the GPU's on `--device cuda`. Mixed on
the CPU (the GPU registry's CPU fallbacks in bf16) is what the CPU tests use to check the
masters' bookkeeping against one process doing the same arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

MASTER = torch.float32


@dataclass
class StagePrecision:
    compute: torch.dtype  # compute copies, activations, boundary tensors
    grads: torch.dtype  # a step's summed gradients and their buckets
    mixed: bool = False
    device: str = "cpu"
    # trained path -> its fp32 master (mixed); empty: the parameters are their own masters
    masters: dict[str, Tensor] = field(default_factory=dict)
    # a frozen path (LoRA's base) -> its fp32 value on the host (mixed): a checkpoint
    # writes what was loaded, not its bf16 copy (as the one-GPU trainer keeps it)
    frozen: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, device: str, dtype: torch.dtype, mixed: bool | None = None
           ) -> "StagePrecision":
        """`mixed` None: the GPU's (bf16 compute, fp32 masters) on cuda, the model's
        `dtype` throughout elsewhere."""
        mixed = device.startswith("cuda") if mixed is None else mixed
        if mixed:
            return cls(torch.bfloat16, MASTER, True, device)
        return cls(dtype, dtype, False, device)

    def kernels(self) -> dict:
        """The kernel registry a stage runs: the GPU step's (mixed), else the reference's
        with the tensors it creates made on the stage's device."""
        if self.mixed:
            from runtime.cuda.attention import DEFAULT_ORDER
            from runtime.cuda.train_kernels import train_kernels

            return train_kernels("cuda" if self.device.startswith("cuda") else "cpu",
                                 attention=DEFAULT_ORDER)
        return kernels_on(self.device)

    def refuse_own_dtypes(self, program, paths) -> None:
        """Mixed: every floating parameter of `paths` computes through a bf16 copy, so one
        the program stores in a dtype of its own (`@dtype(fp32)`, `[d, fp32]`; the
        one-GPU step holds it so: runtime/cuda/param_dtypes.py) is an error, never run
        in bf16."""
        if not self.mixed:
            return
        from runtime.errors import RuntimeUserError
        from runtime.model import parameter_dtypes

        stored = parameter_dtypes(program.graph, self.compute)
        own = sorted(p for p in paths if stored.get(p, self.compute) != self.compute)
        if own:
            raise RuntimeUserError(
                f"--pp on the GPU holds every parameter as a bf16 copy of an fp32 master; "
                f"{', '.join(f'`{p}`' for p in own[:3])} "
                f"{'is' if len(own) == 1 else 'are'} stored in "
                f"{str(stored[own[0]]).replace('torch.', '')} (`@dtype`): not supported "
                "yet", help=["drop the `@dtype` (the parameter then has a bf16 copy and an "
                             "fp32 master), train it on one GPU, or on the CPU "
                             "(`--device cpu`), which stores it as declared"])

    def hold(self, params: dict[str, Tensor], trained: list[str], frozen=()) -> None:
        """Mixed: `trained`'s fp32 masters on the device and `frozen`'s fp32 values on the
        host kept here, and every floating parameter replaced by its compute copy (a
        tensor two paths share stays shared)."""
        if not self.mixed:
            return
        self.masters = {p: params[p].detach().to(MASTER, copy=True) for p in trained}
        self.frozen = {p: params[p].detach().to("cpu", MASTER, copy=True) for p in frozen
                       if params[p].is_floating_point()}
        convert_shared(params, lambda value: value.detach().to(self.compute)
                       if value.is_floating_point() else value)

    def weights(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """What the optimizer steps and a checkpoint holds, by path: the masters, the
        frozen parameters' host values, the parameters themselves elsewhere (unmixed)."""
        if not self.mixed:
            return params
        return {p: self.masters.get(p, self.frozen.get(p, value))
                for p, value in params.items()}

    @torch.no_grad()
    def refresh(self, params: dict[str, Tensor], paths) -> None:
        """The compute copies of `paths` made from their masters again (after a step or a
        load; the copy rounds to nearest, as the GPU step's own update does)."""
        for path in paths:
            master = self.masters.get(path)
            if master is not None:
                params[path].copy_(master)

    @torch.no_grad()
    def load(self, params: dict[str, Tensor], path: str, value: Tensor) -> None:
        """A checkpoint's value of `path` into its master or host value (where it has
        one) and its compute copy."""
        kept = self.masters.get(path, self.frozen.get(path))
        if kept is not None:
            kept.copy_(value)
        params[path].copy_(kept if kept is not None else value)


def convert_shared(params: dict[str, Tensor], convert) -> None:
    """Every parameter replaced by `convert(it)`, a tensor two paths share (a tied one and
    its target) converted once and still shared."""
    done: dict[int, Tensor] = {}
    for path, value in params.items():
        if id(value) not in done:
            done[id(value)] = convert(value)
        params[path] = done[id(value)]


class OnDevice:
    """A reference kernel that creates its tensor (zeros, ones, fill) on `device`: the
    reference makes them on the CPU unless told."""

    def __init__(self, kernel, device: str):
        self.kernel, self.device = kernel, device

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def forward(self, inputs: list, attrs: dict) -> list:
        return self.kernel.forward(inputs, attrs | {"device": self.device})


def kernels_on(device: str) -> dict:
    """The reference kernels, with the ones that create tensors making them on `device`."""
    from runtime.kernels import KERNELS

    if device == "cpu":
        return KERNELS
    created = ("zeros", "ones", "fill")
    return dict(KERNELS) | {n: OnDevice(KERNELS[n], device) for n in created if n in KERNELS}


class DeviceAdamW:
    """AdamW (runtime.train.optim's arithmetic) for mixed stages, with the learning rate
    and the step count held on the device: a captured step (runtime/train/
    pipeline_graph.py) reads the rate `set_lr` writes and counts its own steps. The
    moments live in the wrapped AdamW's dicts (checkpoints read them there); its host
    `step` the trainer counts."""

    def __init__(self, adamw, device: str):
        self.adamw = adamw
        self.lr = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.sync()

    def sync(self) -> None:
        """The device scalars from the host's rate and step (at the start, after set_lr,
        after a load): kernels, no host sync."""
        self.lr.fill_(float(self.adamw.lr))
        self.count.fill_(float(self.adamw.step))

    @torch.no_grad()
    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor], settings,
               scale: Tensor | None = None) -> None:
        """One step of every parameter with a gradient; `settings(path)`: its (lr scale,
        weight decay); `scale`: global clipping's factor."""
        a = self.adamw
        beta1, beta2 = a.betas
        self.count += 1
        bias1 = 1 - beta1 ** self.count
        bias2_sqrt = (1 - beta2 ** self.count).sqrt()
        for path, grad in grads.items():
            param = params[path]
            lr_scale, weight_decay = settings(path)
            lr = self.lr * lr_scale
            if scale is not None:
                grad = grad * scale.to(grad.dtype)
            m, v = (_moment(held, param, path) for held in (a.exp_avg, a.exp_avg_sq))
            if weight_decay:
                param.mul_((1 - lr * weight_decay).to(param.dtype))
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt.to(v.dtype)).add_(a.eps)
            param.add_(m / denom * (-lr / bias1).to(param.dtype))


def _moment(held: dict[str, Tensor], param: Tensor, path: str) -> Tensor:
    """`path`'s moment, zeros made at its first step only (a captured step would
    otherwise fill a fresh tensor it never reads on every replay)."""
    moment = held.get(path)
    if moment is None:
        moment = held[path] = torch.zeros_like(param)
    return moment


@torch.no_grad()
def load_moments(held: dict[str, Tensor], loaded: dict[str, Tensor], paths,
                 device: str) -> None:
    """A checkpoint's moments of `paths` into `held` (AdamW's dict), copied into the
    tensors held where there are any: a captured step (runtime/train/pipeline_graph.py)
    updates those, so a new tensor would never be stepped and a checkpoint would write
    the loaded values for good. A path the checkpoint lacks starts again from zeros."""
    for path in paths:
        value = loaded.get(path)
        if path in held and value is None:
            held[path].zero_()
        elif path in held:
            held[path].copy_(value)
        elif value is not None:
            held[path] = value.to(device, copy=True)
