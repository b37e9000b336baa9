"""Parser throughput on a large realistic file.

The file repeats the spec's 94 complete examples (declarations renamed with a numeric suffix
so that names do not collide) together with a generated Llama-like model whose forward graph
and `hf_mapping:` spell out every layer. It is parsed 3 times (syntax tree with spans, as
`modulec check` builds it); the table gives best and median, and one JSON line follows.

    python benchmarks/parse_speed.py [--lines N] [--repeat R]

Exit status is 0 unless the generated file fails to parse.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from modulec.syntax.parser import parse_text  # noqa: E402
from spec_blocks import declaration_blocks  # noqa: E402

TARGET_LINES_PER_S = 15_000
LAYERS_PER_MODEL = 64
DECL_HEADER = re.compile(r"^((?:abstract\s+)?(?:module|block|model|primitive|recipe)\s+)(\w+)",
                         re.MULTILINE)


def renamed(text: str, suffix: int) -> str:
    return DECL_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}_{suffix}", text)


def layer_mapping(i: int) -> list[str]:
    hf = f"model.layers.{i}"
    return [
        f'    blocks[{i}].ln1.weight: "{hf}.input_layernorm.weight"',
        f"    blocks[{i}].attention.qkv_weight: fuse(",
        f'      "{hf}.self_attn.q_proj.weight",',
        f'      "{hf}.self_attn.k_proj.weight",',
        f'      "{hf}.self_attn.v_proj.weight",',
        "      dim=0",
        "    )",
        f'    blocks[{i}].attention.out_weight: "{hf}.self_attn.o_proj.weight"',
        f'    blocks[{i}].ln2.weight: "{hf}.post_attention_layernorm.weight"',
        f"    blocks[{i}].mlp.up_weight: fuse(",
        f'      "{hf}.mlp.gate_proj.weight",',
        f'      "{hf}.mlp.up_proj.weight",',
        "      dim=0",
        "    )",
        f'    blocks[{i}].mlp.down_weight: "{hf}.mlp.down_proj.weight"',
    ]


def llama_model(suffix: int, layers: int = LAYERS_PER_MODEL) -> str:
    lines = [
        f"model GeneratedLlama_{suffix}(vocab_size: int = 32000, d_model: int = 4096,",
        f"                              n_layers: int = {layers}, num_heads: int = 32):",
        '  """A Llama-like model with every layer written out."""',
        "  params:",
        "    eps: float = 1e-5",
        "    rope_theta: float = 10000.0",
        "    d_head: int = d_model // num_heads",
        "  let:",
        "    d_ff = (8 * d_model // 3 + 255) // 256 * 256",
        "    qkv_dim = (num_heads + 2 * num_heads // 4) * d_head",
        "  forward:",
        "    in: token_ids: [B, T, int32]",
        "    out: [B, T, vocab_size]",
        "    graph:",
        "      token_ids -> embedding(embedding) -> x0",
    ]
    for i in range(layers):
        lines.append(f"      (x{i}, residual{i}) -> blocks[{i}](rope_theta=rope_theta)"
                     f" @checkpoint -> (x{i + 1}, residual{i + 1})")
    lines += [
        f"      (x{layers}, residual{layers}, final_norm) -> fused_residual_rmsnorm(eps=eps)"
        " -> (residualN, xF)",
        "      (xF, lm_head) -> matmul(transpose=NT) -> out",
        "  hf_mapping:",
        '    embedding: "model.embed_tokens.weight"',
        '    final_norm: "model.norm.weight"',
        '    lm_head: "lm_head.weight"',
    ]
    for i in range(layers):
        lines += layer_mapping(i)
    return "\n".join(lines) + "\n"


def generate(min_lines: int) -> str:
    blocks = [text for _, text in declaration_blocks()]
    chunks, count, suffix = [], 0, 0
    while count < min_lines:
        unit = "\n\n".join(renamed(text, suffix) for text in blocks)
        unit += "\n\n" + llama_model(suffix) + "\n"
        chunks.append(unit)
        count += unit.count("\n")
        suffix += 1
    return "".join(chunks)


def time_parse(text: str) -> float:
    start = time.perf_counter()
    result = parse_text(text, "parse_speed.module")
    elapsed = time.perf_counter() - start
    if not result.ok:
        for diagnostic in result.diagnostics[:10]:
            span = diagnostic.primary_span
            print(f"{diagnostic.code} line {span.line if span else '?'}: {diagnostic.message}",
                  file=sys.stderr)
        raise SystemExit("parse_speed: the generated file does not parse")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--lines", type=int, default=50_000, help="minimum file size in lines")
    options.add_argument("--repeat", type=int, default=3, help="timed parses (default 3)")
    args = options.parse_args(argv)

    text = generate(args.lines)
    lines = text.count("\n")
    parse_text("module Warmup:\n  x: 1\n", "warmup")  # load the LALR tables once
    times = [time_parse(text) for _ in range(max(1, args.repeat))]
    best, median = min(times), statistics.median(times)

    print(f"{'':8} {'lines':>8} {'seconds':>9} {'lines/s':>10}")
    for label, seconds in (("best", best), ("median", median)):
        print(f"{label:8} {lines:>8} {seconds:>9.3f} {lines / seconds:>10.0f}")
    print(json.dumps({
        "benchmark": "parse_speed", "lines": lines,
        "best_lines_per_s": round(lines / best), "median_lines_per_s": round(lines / median),
        "target_lines_per_s": TARGET_LINES_PER_S,
        "meets_target": lines / median >= TARGET_LINES_PER_S,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
