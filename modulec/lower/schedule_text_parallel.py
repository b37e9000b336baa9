"""The text form of the Schedule IR's `distributed` and `pipeline` sections (after the
functions and the layout in `modulec build --emit schedule`; docs/build-output.md).

distributed: the mesh, ZeRO stage and streams; one line per bucket (its path template,
instances, flat size and shard; under ZeRO-3 an entry bucket's gather windows) and per
parameter in it (`+offset:numel`); then the collective ops in order, one per line:
trigger, stream, kind, what it acts on (`only`, `window`, `at`: which buckets, when).
pipeline: one line per stage (its units and parameter count), per boundary (the tensors
sent), and per stage its 1F1B ops as tokens: `F3` / `B3` forward / backward of
micro-batch 3, `a3>1` activations of micro-batch 3 sent to stage 1, `g3<1` gradients
received from stage 1; `|` separates warm-up, steady and cool-down. With data parallel
over the pipelines (mesh dp > 1), a stage's gradient buckets follow it, one line each
(`+offset:numel` per parameter; under ZeRO-1 its `owner`), and its ops end in `AR0 AR1
...`: bucket k's all-reduce over the stage's data-parallel group (ZeRO-1: then `OPT`, the
optimizer step, and `BC0 BC1 ...`, each bucket's weights broadcast from its owner). A
parameter the stages share is one line (`shared 0 wte (wte, lm_head) [64, 32]: a copy on
stages 0, 1`), and `SAR0` in a stage's ops is its gradients' sum over those stages.
"""

from __future__ import annotations


UPDATE_TOKENS = {"all_reduce": "AR", "optimizer_step": "OPT", "broadcast": "BC"}


def print_distributed(section: dict) -> str:
    mesh = section["mesh"]
    streams = ", ".join(f"{name} s{number}" for name, number in section["streams"].items())
    lines = [f"distributed (dp {mesh['dp']} x tp {mesh['tp']} x pp {mesh['pp']}, "
             f"ZeRO-{section['zero']}, streams {streams}, align {section['align']}) {{"]
    for bucket in section["buckets"]:
        where = bucket["path"] or bucket["name"]
        count = f" x{bucket['instances']} from {bucket['first']}" \
            if bucket["instances"] > 1 else ""
        windows = f"  windows {','.join(bucket['windows'])}" if "windows" in bucket else ""
        lines.append(f"  bucket {bucket['name']}  {where}{count}  numel {bucket['numel']}  "
                     f"shard {bucket['shard']}{windows}")
        lines += [f"    {p['name']}  [{', '.join(map(str, p['shape']))}]  "
                  f"+{p['offset']}:{p['numel']}" for p in bucket["params"]]
    lines += [_op_line(op) for op in section["ops"]]
    return "\n".join(lines + ["}", ""]) + "\n"


def _op_line(op: dict) -> str:
    extra = [f"{key} {op[key]}" for key in ("what", "event", "into") if key in op]
    if op.get("instance", 0):
        extra.append(f"instance i{op['instance']:+d}")
    extra += [f"{key} {op[key]}" for key in ("only", "window", "at") if key in op]
    if op.get("whole"):
        extra.append("whole")
    return f"  op {op['on']:<15} s{op['stream']}  {op['kind']:<14} {'  '.join(extra)}".rstrip()


def print_pipeline(section: dict) -> str:
    mesh = section.get("mesh", {})
    sizes = " x ".join(f"{k} {mesh[k]}" for k in ("dp", "pp", "tp") if k in mesh)
    if section.get("zero"):
        sizes += f", ZeRO-{section['zero']}"
    lines = [f"pipeline ({len(section['stages'])} stages, {section['microbatches']} "
             f"micro-batches, {section['schedule']}, {section['split']} split; mesh "
             f"{sizes}) {{"]
    for stage in section["stages"]:
        units = ", ".join(_unit(u) for u in stage["units"])
        lines.append(f"  stage {stage['stage']}: {units}  ({len(stage['params'])} parameters; "
                     f"forward {_time(stage['forward_s'])}, backward "
                     f"{_time(stage['backward_s'])} per micro-batch)")
        for number, bucket in enumerate(stage.get("grad_buckets", ())):
            owner = f"  owner {bucket['owner']}" if "owner" in bucket else ""
            lines.append(f"    bucket {number} {bucket['name']}  numel {bucket['numel']}"
                         f"{owner}: " +
                         ", ".join(f"{p['path']} +{p['offset']}:{p['numel']}"
                                   for p in bucket["params"]))
    for number, entry in enumerate(section.get("shared", ())):
        names = f" ({', '.join(entry['paths'])})" if len(entry["paths"]) > 1 else ""
        lines.append(f"  shared {number} {entry['param']}{names} "
                     f"[{', '.join(map(str, entry['shape']))}]: a copy on stages "
                     f"{', '.join(map(str, entry['stages']))}")
    for boundary in section["boundaries"]:
        tensors = ", ".join(f"{t['value']} [{', '.join(map(str, t['shape']))}] {t['dtype']}"
                            for t in boundary["tensors"])
        lines.append(f"  boundary {boundary['from']} -> {boundary['to']}: {tensors}  "
                     f"({boundary['activation_bytes']} bytes a micro-batch)")
    for number, ops in enumerate(section["ops"]):
        lines.append(f"  ops {number}: {_tokens(ops)}")
    return "\n".join(lines + ["}", ""]) + "\n"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3f} us"


def _unit(unit: dict) -> str:
    text = f"{unit['node']} {unit['target']}"
    if "layers" in unit:
        text += " layers {}-{}".format(*unit["layers"])
    if "blocks" in unit:
        text += " (blocks {}-{})".format(*unit["blocks"])
    return text


def _tokens(ops: list) -> str:
    tokens, phase = [], None
    for op in ops:
        if phase is not None and op["phase"] != phase:
            tokens.append("|")
        phase = op["phase"]
        if op.get("group") == "shared":  # a shared parameter's sum over its stages
            tokens.append(f"SAR{op['shared']}")
            continue
        if op["kind"] in UPDATE_TOKENS:  # the DP group's reduction and ZeRO-1's update
            tokens.append(UPDATE_TOKENS[op["kind"]] + str(op.get("bucket", "")))
            continue
        m = op["microbatch"]
        if op["kind"] in ("forward", "backward"):
            tokens.append(f"{op['kind'][0].upper()}{m}")
        else:
            arrow = ">" if op["kind"] == "send" else "<"
            tokens.append(f"{op['what'][0]}{m}{arrow}{op['peer']}")
    return " ".join(tokens)
