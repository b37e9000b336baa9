"""The hostile-program fuzz run (issue 16): mutated programs through `modulec check`, and
`modulec build` for those that check clean, in-process (click's CliRunner: the same
command functions, exit codes and output as the command line, without a process each).

Asserted for every program: exit status 0 or 1 (never 101, the internal-error status),
no traceback in the output, each command under a time cap, and no `build` error but E012
(no model, a size to give) for a program that `check` accepted. The CI test
(tests/test_fuzz.py) runs a fixed slice; the full run:

    .venv/bin/python tests/fuzz/run_fuzz.py --n 3000 [--seed 0] [--keep DIR]
        [--gentle [--verify]]

prints the tally, the slowest program, the process's peak memory and every failure (with
`--keep DIR`, each failing program is written there to reproduce it).
"""

from __future__ import annotations

import argparse
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from click.testing import CliRunner  # noqa: E402

from modulec.cli.main import modulec  # noqa: E402
from tests.fuzz.mutate import Mutant, gentle_mutant, mutant  # noqa: E402

CAP_S = 20.0  # one command on one program (check takes ~0.05 s, build ~0.3 s)


class TimeCap(BaseException):  # not an Exception: the CLI's crash handler lets it through
    pass


@dataclass
class Report:
    programs: int = 0
    tally: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)  # (mutant, command, why, output)
    slowest: tuple = (0.0, None, "")  # (seconds, mutant, command)

    def summary(self) -> str:
        seconds, slow, command = self.slowest
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        lines = [f"{self.programs} programs: " + ", ".join(
                     f"{k} {v}" for k, v in sorted(self.tally.items())),
                 f"slowest: {seconds:.2f} s ({command} of program {slow.index} from "
                 f"{slow.source}: {'; '.join(slow.edits)})" if slow else "slowest: none",
                 f"peak memory of the process: {peak:.2f} GiB",
                 f"failures: {len(self.failures)}"]
        lines += [f"  program {m.index} ({m.source}: {'; '.join(m.edits)}): {c}: {why}"
                  for m, c, why, _ in self.failures]
        return "\n".join(lines)


def fuzz(indices, seed: int, folder: Path, cap_s: float = CAP_S, gentle: bool = False,
         verify: bool = False) -> Report:
    """`gentle`: tests.fuzz.mutate.gentle_mutant's programs; `verify`: a program that
    checks clean and has `verify_backward:` sizes also goes through --verify-backward
    (needs torch), where a 'cannot verify' error is a failure (a FAIL row is not: a
    mutated backward may be wrong)."""
    report = Report()
    runner = CliRunner()
    for index in indices:
        program = (gentle_mutant if gentle else mutant)(index, seed)
        report.programs += 1
        path = folder / f"fuzz_{index}.module"
        path.write_text(program.text, encoding="utf-8", errors="surrogateescape")
        code = _command(report, runner, program, ["check", str(path)], cap_s)
        if code == 0:
            code = _command(report, runner, program, ["build", str(path), "-o",
                                                      str(folder / "fuzz.ir")], cap_s,
                            accepted=True)
            report.tally[f"built (exit {code})"] += 1
            if verify and "verify_backward:" in program.text:
                code = _command(report, runner, program, ["check", "--verify-backward",
                                                          str(path)], cap_s * 6, accepted=True,
                                slow_ok=True)
                report.tally[f"verified (exit {code})"] += 1
        else:
            report.tally[f"check exit {code}"] += 1
        path.unlink()
    return report


def _command(report: Report, runner: CliRunner, program: Mutant, args: list, cap_s: float,
             accepted: bool = False, slow_ok: bool = False):
    """`slow_ok`: over the cap is tallied, not a failure (--verify-backward's finite
    differences grow with the sizes: Mistral's verify sizes with 64 layers, not 2, take
    minutes, and that is no bug)."""
    def expire(*_):
        raise TimeCap()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    start = time.perf_counter()
    try:
        result = runner.invoke(modulec, args)
    except TimeCap:
        if not slow_ok:
            report.failures.append((program, args[0], f"over {cap_s} s", ""))
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - start
    if seconds > report.slowest[0]:
        report.slowest = (seconds, program, args[0])
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    why = _wrong(result, output) or (_refused(output) if accepted else None)
    if why:
        report.failures.append((program, args[0], why, output))
    return result.exit_code


def _wrong(result, output: str) -> str | None:
    if result.exit_code not in (0, 1):
        where = next((line for line in output.splitlines() if "note: in " in line), "")
        return f"exit {result.exit_code} {where.strip()}".strip()
    if "Traceback" in output:
        return "a traceback in the output"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"{type(result.exception).__name__}: {result.exception}"
    return None


def _refused(output: str) -> str | None:
    """`build` of a program that `check` accepted: what check accepts builds, so its only
    errors are E012's (no model in the file, a size to give with --set)."""
    errors = [line for line in output.splitlines()
              if line.startswith(("error[", "error: cannot verify"))]
    other = next((line for line in errors if not line.startswith("error[E012]")), None)
    return f"check accepted, then: {other[:160]}" if other else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="programs (default 3000)")
    parser.add_argument("--start", type=int, default=0, help="first program index")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=float, default=CAP_S, help="seconds per command")
    parser.add_argument("--keep", type=Path, help="write failing programs here")
    parser.add_argument("--gentle", action="store_true",
                        help="small-value edits of models and verify_backward: files")
    parser.add_argument("--verify", action="store_true",
                        help="also --verify-backward those with verify_backward: sizes")
    options = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        report = fuzz(range(options.start, options.start + options.n), options.seed,
                      Path(folder), options.cap, options.gentle, options.verify)
    print(report.summary())
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    if options.keep:
        options.keep.mkdir(parents=True, exist_ok=True)
        for program, command, why, output in report.failures:
            (options.keep / f"fuzz_{program.index}.module").write_text(
                program.text, encoding="utf-8", errors="surrogateescape")
            (options.keep / f"fuzz_{program.index}.txt").write_text(
                f"{command}: {why}\n{output}", encoding="utf-8", errors="replace")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
