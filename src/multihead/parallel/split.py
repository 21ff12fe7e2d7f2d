"""How heads and positions split over ranks: the rules of :mod:`multihead.parallel`, which the cost model
(:mod:`multihead.cost_parallel`, ``multihead cost --tp/--cp``) applies too. Pure functions of the sizes: no
process group needed, nothing but the error helpers imported (the cost model sits below the parallel layers and
imports this module alone)."""

from __future__ import annotations

from multihead._errors import bad_argument

__all__ = ["check_head_split", "check_sequence_split", "ulysses_kv_heads"]


def check_head_split(num_heads: int, num_kv_heads: int, world_size: int, *, argument: str = "group") -> None:
    """Raise a ValueError unless ``world_size`` ranks can split h = ``num_heads`` query heads and g =
    ``num_kv_heads`` key/value heads evenly (P divides h and g; the message lists the valid P, the divisors of g).

    ``argument`` names what set P in the message (``group`` for :func:`multihead.parallel.shard_heads`, ``--tp``
    on the command line). A pure function: no process group needed.
    """
    if num_heads % world_size == 0 and num_kv_heads % world_size == 0:
        return
    valid = [p for p in range(1, num_kv_heads + 1) if num_heads % p == 0 and num_kv_heads % p == 0]
    raise bad_argument(
        argument,
        f"a group size P that divides num_heads = {num_heads} and num_kv_heads = {num_kv_heads} "
        f"(each rank holds h/P query heads and g/P key/value heads)",
        f"P = {world_size} (h % P = {num_heads % world_size}, g % P = {num_kv_heads % world_size})",
        f"use a group of one of the sizes {valid}",
    )


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, world_size: int, *, q_argument: str, kv_argument: str) -> int:
    """The key/value heads Ulysses sends round over ``world_size`` ranks: g, or P when each kv head is replicated
    P/g times; a ValueError naming h, g and P when P divides neither (``q_argument``/``kv_argument`` name them)."""
    h, g, world = num_heads, num_kv_heads, world_size
    if h % world:
        raise bad_argument(
            q_argument,
            f"a number of query heads h divisible by the P = {world} ranks (Ulysses gives each rank h/P heads)",
            f"h = {h}, g = {g}, P = {world}",
            "use ring attention (any number of heads), or a group whose size divides h",
        )
    if g % world == 0:
        return g
    if world % g == 0:
        return world  # each kv head replicated P/g times: rank r gets the one kv head its h/P query heads read
    raise bad_argument(
        kv_argument,
        f"a number of kv heads g divisible by P = {world}, or dividing it (then kv heads are replicated)",
        f"h = {h}, g = {g}, P = {world}",
        "use ring attention, or a group size P with g % P == 0 or P % g == 0",
    )


def check_sequence_split(seq: int, world_size: int, *, parts_per_rank: int = 1, argument: str = "seq") -> int:
    """n/P, the positions per rank; a ValueError unless ``seq`` splits into ``parts_per_rank`` x P equal chunks
    (2 for the zigzag layout)."""
    chunks = parts_per_rank * world_size
    if seq % chunks:
        raise bad_argument(
            argument,
            f"a sequence length divisible by {chunks} ({parts_per_rank} chunk(s) on each of P = {world_size} ranks)",
            f"n = {seq}",
            f"pad the sequence to {-(-seq // chunks) * chunks} and mark the padded keys as padding",
        )
    return seq // world_size
