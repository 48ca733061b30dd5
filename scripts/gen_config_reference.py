"""Write docs/reference/config.md, the reference of every setting of `yatt-mm rl` and `yatt-mm sft`,
from the config dataclasses (the same source as `--help-config`: field line comments and RANGES).

    python scripts/gen_config_reference.py           # rewrite it (also: make config-reference)
    python scripts/gen_config_reference.py --check   # exit 1 when the file is stale

tests/cli/test_architecture.py fails when the committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = ROOT / "docs" / "reference" / "config.md"
COMMAND = "make config-reference (python scripts/gen_config_reference.py)"

HEADER = """\
# Configuration reference

Every setting of `yatt-mm rl` and `yatt-mm sft`: the dotted name to use in a YAML config
(`--config FILE`) or as `key=value` on the command line, its type, its default, the values it
allows and what it does. A value outside its range stops the command before any rank starts
(exit 2) with the setting's name, e.g. `yatt-mm rl: config error: rollout.sampling.n must be >= 1,
got 0`. `name[].key` is a key of each item of a list of sections (`reward.judges`).

Generated from the config dataclasses by `python scripts/gen_config_reference.py` (`make
config-reference`); do not edit by hand. `yatt-mm rl --help-config --markdown` (and `sft`) prints
the same tables, `--help-config` a line per setting.
"""


def render() -> str:
    from yatt_mm.config import markdown
    from yatt_mm.rl.config import RLConfig
    from yatt_mm.sft.config import SFTConfig

    return f"{HEADER}\n{markdown(RLConfig, '`yatt-mm rl`')}\n\n{markdown(SFTConfig, '`yatt-mm sft`')}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PATH.is_file() or PATH.read_text() != text:
            print(f"{PATH.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text)
    print(f"wrote {PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
