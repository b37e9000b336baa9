"""`--fp8-scaling`, `--fp8-gradient`, `--fp8-history`: the std FP8 recipe's scaling and
gradient format chosen for one build (`modulec build`, `plan`, `train` with `--precision
fp8`; modulec.lower.fp8_recipe.std_recipe). decisions.md, "FP8 recipes"."""

from __future__ import annotations

import click

GRADIENTS = {"e5m2": "fp8_e5m2", "e4m3": "fp8_e4m3"}
FLAGS = {"fp8_scaling": "--fp8-scaling", "fp8_gradient": "--fp8-gradient",
         "fp8_history": "--fp8-history"}


def fp8_option_list() -> list:
    """The three options (defaults None: not given leaves the std recipe as it is)."""
    return [
        click.option("--fp8-scaling", type=click.Choice(["delayed", "current"]),
                     help="With --precision fp8: delayed (default: each operand scaled by "
                          "the max of its last --fp8-history amaxes) or current (by its "
                          "own amax now)."),
        click.option("--fp8-gradient", type=click.Choice(list(GRADIENTS)),
                     help="With --precision fp8: the gradients' FP8 format, e5m2 (default) "
                          "or e4m3 (as the forward's)."),
        click.option("--fp8-history", type=click.IntRange(1), metavar="N",
                     help="With --precision fp8 and delayed scaling: the amax history's "
                          "length (default 16)."),
    ]


def fp8_options(command):
    """The options as decorators (build, plan; train takes fp8_option_list)."""
    for option in reversed(fp8_option_list()):
        command = option(command)
    return command


def fp8_overrides(precision, fp8_scaling=None, fp8_gradient=None,
                  fp8_history=None) -> dict | None:
    """The std recipe's overrides the options give (BuildRequest.precision_overrides;
    None: none given); a usage error for one given without `--precision fp8`, or
    --fp8-history with current scaling (never accepted and ignored)."""
    values = {"fp8_scaling": fp8_scaling, "fp8_gradient": fp8_gradient,
              "fp8_history": fp8_history}
    given = [FLAGS[k] for k, v in values.items() if v is not None]
    if not given:
        return None
    if precision != "fp8":
        one = len(given) == 1
        raise click.UsageError(f"{', '.join(given)} {'sets' if one else 'set'} the std FP8 "
                               f"recipe's scaling or format: give {'it' if one else 'them'} "
                               "with --precision fp8")
    if fp8_scaling == "current" and fp8_history is not None:
        raise click.UsageError("--fp8-history is the delayed scaling's amax history; "
                               "--fp8-scaling current scales by each tensor's own amax")
    overrides = {"scaling": fp8_scaling, "gradient": GRADIENTS.get(fp8_gradient),
                 "history_len": fp8_history}
    return {k: v for k, v in overrides.items() if v is not None}
