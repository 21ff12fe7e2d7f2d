"""Index lists the caller passes (layers, heads, query rows): one validator, one meaning for every entry point.

``attention``'s :class:`~multihead.WeightSelection`, head surgery (ablate, gate, prune), capture and the reports
all take indices through :func:`checked_indices`: whole numbers, a negative one counting from the end as Python's
own indexing does (-1 is the last head), each validated against the count it indexes.
"""

from __future__ import annotations

from collections.abc import Set

from multihead._errors import bad_argument, describe

__all__ = ["checked_indices"]


def checked_indices(
    name: str, chosen: object, count: int, what: str, *, distinct: bool = False, ordered: bool = True
) -> list[int]:
    """``chosen`` as indices into range(``count``), in the order given: an int is one index, None all of them,
    a negative index counts from the end. ``distinct``: each index at most once. ``ordered``: the result's order
    is the caller's (rows of a result), so a set, which has none, is refused; False where the order does not
    matter (heads to ablate). ``what`` names one index in messages ("head", "layer", "query").

    Raises TypeError for anything but whole numbers (and, ``ordered``, for a set), and ValueError for an empty
    list, an index outside -count..count - 1 or, with ``distinct``, an index given twice (also as its negative
    twin).
    """
    if chosen is None:
        return list(range(count))
    if ordered and isinstance(chosen, Set):
        raise bad_argument(
            name,
            f"an ordered list of {what} indices (the result comes in their order)",
            f"a {type(chosen).__name__}, whose order is its hashing's",
            f"pass a list, e.g. {name}=sorted(...)",
            kind=TypeError,
        )
    values: list | None = None
    if isinstance(chosen, int):
        values = [chosen]
    elif not isinstance(chosen, (str, bytes)):  # a string is a sequence, but not of indices
        try:
            values = list(chosen)  # type: ignore[call-overload]
        except TypeError:
            values = None
    if values is None:
        raise bad_argument(
            name, f"an int or a list of {what} indices", describe(chosen), f"pass e.g. {name}=[0, 1]", kind=TypeError
        )
    result = []
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_argument(
                name, f"{what} indices (int)", describe(value), f"pass e.g. {name}=[0, 1]", kind=TypeError
            )
        if not -count <= value < count:
            raise bad_argument(
                name,
                f"{what} indices in 0..{count - 1} (or -{count}..-1, from the end)",
                value,
                f"there are {count} {what}s; pick indices below {count}",
            )
        result.append(value % count)
    if not result:
        raise bad_argument(name, f"at least one {what} index", "an empty list", f"pass None for every {what}")
    if distinct and len(set(result)) != len(result):
        twice = next(index for index in result if result.count(index) > 1)
        raise bad_argument(name, f"each {what} once", f"{what} {twice} twice", f"list each {what} once")
    return result
