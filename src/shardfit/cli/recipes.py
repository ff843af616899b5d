"""`shardfit recipes`: the ready-made configs shipped in config/recipes, used with --config recipe:NAME."""

from __future__ import annotations

from shardfit.errors import ShardfitError


def recipes(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("shardfit recipes: list the ready-made configs shipped with shardfit; use one with --config recipe:NAME")
        return 0
    if argv:
        raise ShardfitError(f"unexpected argument '{argv[0]}'", where="shardfit recipes", fix="give no arguments")
    from shardfit.config.recipes import listing

    print(listing())
    return 0
