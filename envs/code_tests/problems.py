"""The problems of ``code-tests``: generated here, deterministically, from a few dozen families.

Each family is a small function-writing task with parameters written into its statement (the divisors
of a FizzBuzz, the shift of a Caesar cipher, the calendar of a leap-year count...), so its variants
are different problems with different answers. Every problem carries a reference solution as source
text, rendered by ``specialize`` from a typed function of ``reference_solutions`` with the variant's
parameters written in; the hidden tests' expected values are computed by running that very source on
generated inputs, so the gold solution and the tests cannot disagree. Inputs come from a
``random.Random`` seeded with the problem's id: the set is the same on every machine and in every
process.

Values are compared as canonical JSON (``canonical``): tuples equal lists, ``True`` is not ``1``,
``3.0`` is not ``3``.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import string
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from envs.code_tests import reference_solutions as reference
from envs.code_tests.specialize import specialize

TESTS_PER_PROBLEM = 8
SPLITS = ("all", "train", "test")
TEST_SHARE = 5  # one problem in five (by a hash of its id) is held out in the "test" split

Args = tuple[Any, ...]
Inputs = Callable[[random.Random], Args]


@dataclass(frozen=True)
class Problem:
    """One task: write ``function``; ``inputs[i]`` are hidden test i's arguments, ``expected[i]`` the
    canonical JSON of the right answer."""

    id: str
    function: str
    statement: str
    solution: str
    inputs: tuple[Args, ...]
    expected: tuple[str, ...]

    def prompt(self) -> str:
        return (
            f"{self.statement}\n\n"
            f"You may run Python with the `python` tool first. Hidden tests call `{self.function}` "
            "directly. When you are done, reply with the complete function in one ```python code block."
        )

    def split(self) -> str:
        return "test" if zlib.crc32(self.id.encode()) % TEST_SHARE == 0 else "train"


def canonical(value: Any) -> str:
    """The form answers are compared in (the grader in the sandbox writes exactly this)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class _Draft:
    key: str
    function: str
    statement: str
    solution: str
    make_input: Inputs
    fixed: tuple[Args, ...] = ()


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# --- input helpers ------------------------------------------------------------------------------


def _ints(rng: random.Random, low: int, high: int, length: tuple[int, int]) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(*length))]


def _word(rng: random.Random, letters: str = "abcde", length: tuple[int, int] = (1, 6)) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(*length)))


def _text(rng: random.Random, alphabet: str, length: tuple[int, int]) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(*length)))


def _grid(rng: random.Random, max_side: int = 5) -> list[list[int]]:
    rows, cols = rng.randint(1, max_side), rng.randint(1, max_side)
    return [[rng.randint(0, 9) for _ in range(cols)] for _ in range(rows)]


def _one_arg(make: Callable[[random.Random, Any], Any], parameter: Any, rng: random.Random) -> Args:
    """``(make(rng, parameter),)``: an input maker bound to a variant's parameter with functools.partial."""
    return (make(rng, parameter),)


def _palindrome_or_not(rng: random.Random, alphabet: str) -> str:
    half = _text(rng, alphabet, (0, 6))
    middle = rng.choice(["", rng.choice(alphabet)])
    text = half + middle + half[::-1]
    if rng.random() < 0.4 and text:
        index = rng.randrange(len(text))
        text = text[:index] + rng.choice(alphabet) + text[index + 1 :]
    return text


# --- the families -------------------------------------------------------------------------------


def _sum_multiples() -> Iterator[_Draft]:
    pairs = [(3, 5), (2, 7), (4, 6), (3, 7), (5, 8), (2, 9), (6, 9), (4, 10), (7, 11), (3, 8)]
    pairs += [(2, 3), (5, 7), (4, 9), (6, 10), (3, 11), (8, 12), (2, 5), (7, 9), (5, 6), (9, 13)]
    for a, b in pairs:
        yield _Draft(
            f"{a}-{b}",
            "sum_multiples",
            f"Write a function `sum_multiples(n)` that returns the sum of all positive integers below "
            f"`n` that are divisible by {a} or by {b} (or both). For n <= 1 the sum is 0.",
            specialize(reference.sum_multiples, DIVISOR_A=a, DIVISOR_B=b),
            lambda rng: (rng.randint(2, 3000),),
            ((-3,), (1,), (max(a, b) + 1,)),
        )


def _count_digit() -> Iterator[_Draft]:
    for digit in range(10):
        yield _Draft(
            str(digit),
            "count_digit",
            f"Write a function `count_digit(n)` that returns how many times the digit {digit} appears in "
            "the decimal representation of the non-negative integer `n` (0 is written as 0).",
            specialize(reference.count_digit, DIGIT=str(digit)),
            lambda rng: (rng.randint(0, 10 ** rng.randint(1, 15)),),
            ((0,), (digit,), (int(str(digit) * 5),)),
        )


def _digits_at_least() -> Iterator[_Draft]:
    for digit in range(1, 10):
        yield _Draft(
            str(digit),
            "digits_at_least",
            f"Write a function `digits_at_least(n)` that returns how many decimal digits of the "
            f"non-negative integer `n` are {digit} or greater.",
            specialize(reference.digits_at_least, MIN_DIGIT=digit),
            lambda rng: (rng.randint(0, 10 ** rng.randint(1, 12)),),
            ((0,), (digit,)),
        )


def _caesar() -> Iterator[_Draft]:
    alphabet = string.ascii_letters + "  ,.!?0123"
    for shift in range(1, 26):
        yield _Draft(
            str(shift),
            "caesar",
            f"Write a function `caesar(text)` that shifts every ASCII letter of `text` forward by "
            f"{_plural(shift, 'place')} in the alphabet, wrapping around from z to a, and keeps its case; "
            "every other character stays as it is.",
            specialize(reference.caesar, SHIFT=shift),
            lambda rng: (_text(rng, alphabet, (0, 30)),),
            (("",), ("Zz Aa!",)),
        )


def _fizzbuzz() -> Iterator[_Draft]:
    variants = [(3, 5, "Fizz", "Buzz"), (2, 3, "Foo", "Bar"), (4, 7, "Ping", "Pong"), (3, 4, "Tic", "Tac")]
    variants += [
        (5, 6, "Hop", "Skip"),
        (2, 5, "Even", "Five"),
        (3, 7, "Lucky", "Seven"),
        (6, 8, "Zip", "Zap"),
    ]
    variants += [(2, 9, "Duo", "Nine"), (4, 5, "Quad", "Quint"), (3, 10, "Tri", "Dec"), (7, 8, "Sev", "Oct")]
    variants += [(5, 9, "Pent", "Non"), (2, 11, "Pair", "Eleven"), (3, 6, "Thrice", "Six")]
    for a, b, word_a, word_b in variants:
        yield _Draft(
            f"{a}-{b}",
            "fizzbuzz",
            "Write a function `fizzbuzz(n)` that returns a list of strings for the numbers 1 to `n` in "
            f'order: "{word_a}{word_b}" for numbers divisible by both {a} and {b}, "{word_a}" for the other '
            f'multiples of {a}, "{word_b}" for the other multiples of {b}, and the number itself as a string '
            "otherwise. For n < 1 the list is empty.",
            specialize(reference.fizzbuzz, DIVISOR_A=a, DIVISOR_B=b, WORD_A=word_a, WORD_B=word_b),
            lambda rng: (rng.randint(2, 45),),
            ((0,), (1,), (a * b,)),
        )


def _palindrome() -> Iterator[_Draft]:
    rules = [
        ("exact", "exactly as written", reference.is_palindrome_exact, "abAB a"),
        ("case", "ignoring the case of letters", reference.is_palindrome_ignoring_case, "abAB a"),
        (
            "alnum",
            "ignoring case and every character that is not a letter or a digit (str.isalnum)",
            reference.is_palindrome_alnum,
            "abAB1 ,.",
        ),
    ]
    for key, rule, solution, alphabet in rules:
        yield _Draft(
            key,
            "is_palindrome",
            f"Write a function `is_palindrome(s)` that returns True if the string `s` reads the same "
            f"forwards and backwards {rule}, and False otherwise.",
            specialize(solution, "is_palindrome"),
            functools.partial(_one_arg, _palindrome_or_not, alphabet),
            (("",), ("Ab,a",), ("abBA",)),
        )


def _run_length() -> Iterator[_Draft]:
    formats = [
        ("char-count", 'the character followed by the run\'s length ("aaab" -> "a3b1")'),
        ("count-char", 'the run\'s length followed by the character ("aaab" -> "3a1b")'),
        (
            "omit-one",
            'the character, followed by the run\'s length only when it is more than 1 ("aaab" -> "a3b")',
        ),
    ]
    for key, rule in formats:
        yield _Draft(
            key,
            "run_length",
            f"Write a function `run_length(s)` that encodes the string `s` (letters only) by its runs of "
            f'equal consecutive characters: each run becomes {rule}. The empty string encodes to "".',
            specialize(reference.run_length, RUN_FORMAT=key),
            lambda rng: ("".join(rng.choice("abc") * rng.randint(1, 12) for _ in range(rng.randint(1, 5))),),
            (("",), ("a",), ("zzzzzzzzzzzz",)),
        )


def _recurrence() -> Iterator[_Draft]:
    variants = [(0, 1, 1000), (2, 1, 1000), (1, 1, 97), (3, 4, 1009), (0, 2, 10007), (5, 0, 256)]
    variants += [(1, 3, 1000003), (2, 2, 99), (7, 1, 4096), (4, 9, 10**9 + 7), (1, 0, 60), (3, 3, 101)]
    variants += [(6, 5, 12345), (0, 7, 777), (9, 1, 1024), (2, 5, 31), (8, 8, 100), (1, 2, 65537)]
    variants += [(4, 1, 9973), (3, 0, 2**20)]
    for first, second, modulus in variants:
        yield _Draft(
            f"{first}-{second}-{modulus}",
            "term",
            f"Write a function `term(n)` that returns a(n) modulo {modulus} for n >= 0, where "
            f"a(0) = {first}, a(1) = {second} and a(n) = a(n-1) + a(n-2) for n >= 2.",
            specialize(reference.term, FIRST=first, SECOND=second, MODULUS=modulus),
            lambda rng: (rng.randint(2, 5000),),
            ((0,), (1,), (2,)),
        )


def _digit_power_sum() -> Iterator[_Draft]:
    for power in range(1, 10):
        yield _Draft(
            str(power),
            "digit_power_sum",
            f"Write a function `digit_power_sum(n)` that returns the sum of the decimal digits of the "
            f"non-negative integer `n`, each raised to the power {power}.",
            specialize(reference.digit_power_sum, POWER=power),
            lambda rng: (rng.randint(0, 10 ** rng.randint(1, 12)),),
            ((0,), (9,)),
        )


def _base_digit_sum() -> Iterator[_Draft]:
    for base in range(2, 17):
        yield _Draft(
            str(base),
            "base_digit_sum",
            f"Write a function `base_digit_sum(n)` that returns the sum of the digits (as numbers) of the "
            f"non-negative integer `n` written in base {base}.",
            specialize(reference.base_digit_sum, BASE=base),
            lambda rng: (rng.randint(0, 10 ** rng.randint(1, 12)),),
            ((0,), (base - 1,), (base,)),
        )


def _count_with_divisors() -> Iterator[_Draft]:
    for k in (1, 2, 3, 4, 5, 6, 8, 9, 10, 12):
        yield _Draft(
            str(k),
            "count_with_divisors",
            f"Write a function `count_with_divisors(n)` that returns how many integers from 1 to `n` "
            f"(inclusive) have exactly {_plural(k, 'positive divisor')}. For n < 1 the answer is 0.",
            specialize(reference.count_with_divisors, DIVISOR_COUNT=k),
            lambda rng: (rng.randint(2, 1500),),
            ((0,), (1,), (16,)),
        )


def _reduce_numbers() -> Iterator[_Draft]:
    positive = lambda rng: (_ints(rng, 1, 60, (1, 8)),)  # noqa: E731 - a one-line input maker
    signed = lambda rng: (_ints(rng, -50, 50, (1, 10)),)  # noqa: E731
    variants: list[tuple[str, str, Callable[..., object], Inputs, tuple[Args, ...]]] = [
        (
            "gcd_all",
            "the greatest common divisor of all numbers in the non-empty list `xs` of positive integers",
            reference.gcd_all,
            positive,
            (([12],), ([4, 6],)),
        ),
        (
            "lcm_all",
            "the least common multiple of all numbers in the non-empty list `xs` of positive integers",
            reference.lcm_all,
            positive,
            (([7],), ([4, 6],)),
        ),
        (
            "spread",
            "the largest minus the smallest number of the non-empty list `xs`",
            reference.spread,
            signed,
            (([5],),),
        ),
        (
            "sum_squares",
            "the sum of the squares of the numbers in the list `xs` (0 for an empty list)",
            reference.sum_squares,
            signed,
            (([],),),
        ),
        (
            "product_mod",
            "the product of the numbers in the list `xs` modulo 1000003, as a number from 0 to 1000002 "
            "(1 for an empty list)",
            reference.product_mod,
            signed,
            (([],), ([-1],)),
        ),
        (
            "distinct_count",
            "how many different values the list `xs` holds",
            reference.distinct_count,
            signed,
            (([],),),
        ),
        (
            "odd_sum",
            "the sum of the odd numbers in the list `xs` (negative ones included)",
            reference.odd_sum,
            signed,
            (([],), ([-3, 2],)),
        ),
        (
            "max_abs",
            "the largest absolute value among the numbers of the non-empty list `xs`",
            reference.max_abs,
            signed,
            (([-9, 3],),),
        ),
    ]
    for name, what, solution, make, fixed in variants:
        yield _Draft(
            name,
            name,
            f"Write a function `{name}(xs)` that returns {what}.",
            specialize(solution, name),
            make,
            fixed,
        )


def _kth_value() -> Iterator[_Draft]:
    for k in range(1, 6):
        for order in ("largest", "smallest"):
            ordinal = {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")
            yield _Draft(
                f"{order}-{k}",
                f"kth_{order}",
                f"Write a function `kth_{order}(xs)` that returns the {ordinal} {order} distinct value in "
                f"the list of integers `xs` (equal values count once), or None if `xs` holds fewer than "
                f"{_plural(k, 'distinct value')}.",
                specialize(reference.kth_value, f"kth_{order}", K=k, LARGEST=order == "largest"),
                lambda rng: (_ints(rng, -20, 20, (0, 12)),),
                (([],), ([3, 3, 3],)),
            )


def _word_counts() -> Iterator[_Draft]:
    words = ["apple", "Apple", "pear", "PEAR", "fig", "kiwi", "Fig", "plum"]
    for minimum in range(1, 5):
        for lower in (True, False):
            rule = "lowercases each word" if lower else "keeps each word exactly as written"
            yield _Draft(
                f"{minimum}-{'lower' if lower else 'exact'}",
                "word_counts",
                f"Write a function `word_counts(text)` that splits `text` on whitespace, {rule}, and returns "
                f"a dict that maps each word occurring at least {_plural(minimum, 'time')} to its number of "
                "occurrences.",
                specialize(reference.word_counts, MIN_COUNT=minimum, LOWERCASE=lower),
                lambda rng: (" ".join(rng.choice(words) for _ in range(rng.randint(0, 14))),),
                (("",), ("  Fig\tfig\n",)),
            )


def _balanced() -> Iterator[_Draft]:
    sets = ["()", "[]", "{}", "<>", "()[]", "(){}", "()<>", "[]{}", "[]<>", "{}<>"]
    sets += ["()[]{}", "()[]<>", "(){}<>", "[]{}<>", "()[]{}<>"]
    for brackets in sets:
        pairs = {brackets[i + 1]: brackets[i] for i in range(0, len(brackets), 2)}
        shown = " ".join(brackets[i : i + 2] for i in range(0, len(brackets), 2))
        yield _Draft(
            brackets,
            "balanced",
            f"Write a function `balanced(s)` that returns True if the brackets {shown} in the string `s` are "
            "balanced and properly nested, and False otherwise. Every other character (other kinds of "
            "brackets included) is ignored.",
            specialize(reference.balanced, CLOSING=pairs),
            functools.partial(_one_arg, _brackets_or_noise, brackets),
            (("",), (brackets,), (brackets[::-1],), (brackets[0] * 2 + brackets[1] * 2,)),
        )


def _nested_brackets(rng: random.Random, brackets: str) -> str:
    """A balanced string (half the tests), with noise characters between the brackets."""
    out: list[str] = []
    for _ in range(rng.randint(1, 4)):
        pair = rng.randrange(0, len(brackets), 2)
        inner = _nested_brackets(rng, brackets) if rng.random() < 0.3 else rng.choice(["", "x", "ab"])
        out.append(brackets[pair] + inner + brackets[pair + 1])
    return "".join(out)


def _brackets_or_noise(rng: random.Random, brackets: str) -> str:
    if rng.random() < 0.5:
        return _nested_brackets(rng, brackets)
    return _text(rng, brackets * 3 + "x()[]{}<>", (0, 14))


def _collatz() -> Iterator[_Draft]:
    variants = [
        ("steps", "how many steps it takes to reach 1 (0 for n = 1)"),
        ("peak", "the largest value the sequence reaches, n included"),
        ("odd", "how many odd values the sequence visits, n and the final 1 included"),
        ("length", "how many values the sequence has, n and the final 1 included"),
    ]
    for key, what in variants:
        yield _Draft(
            key,
            f"collatz_{key}",
            f"Write a function `collatz_{key}(n)` that, for an integer n >= 1, follows the Collatz rule "
            "(an even value v becomes v // 2, an odd value v > 1 becomes 3 * v + 1, stop at 1) and returns "
            f"{what}.",
            specialize(reference.collatz, f"collatz_{key}", COLLATZ_RESULT=key),
            lambda rng: (rng.randint(2, 10000),),
            ((1,), (2,), (27,)),
        )


def _merge_intervals() -> Iterator[_Draft]:
    touching = {
        True: "intervals that overlap or touch (share an end point) are merged",
        False: "intervals that overlap are merged, but ones that only touch at an end point are not",
    }
    results = {
        "list": "the merged intervals as a list of [start, end] pairs sorted by start",
        "count": "how many intervals remain after merging",
        "length": "the total length covered (the sum of end - start over the merged intervals)",
    }
    for touch, rule in touching.items():
        for key, what in results.items():
            yield _Draft(
                f"{'touch' if touch else 'overlap'}-{key}",
                "merge_intervals",
                f"Write a function `merge_intervals(intervals)` that takes a list of [start, end] pairs of "
                f"integers (start <= end, in any order) where {rule}, and returns {what}.",
                specialize(reference.merge_intervals, TOUCHING=touch, MERGED_RESULT=key),
                lambda rng: (
                    [sorted((rng.randint(0, 30), rng.randint(0, 30))) for _ in range(rng.randint(0, 7))],
                ),
                (([],), ([[1, 3], [3, 5]],), ([[4, 4], [1, 2]],)),
            )


def _grid_transform() -> Iterator[_Draft]:
    variants = [
        ("rotate_cw", "rotated 90 degrees clockwise", reference.rotate_cw),
        ("rotate_ccw", "rotated 90 degrees counter-clockwise", reference.rotate_ccw),
        ("rotate_half", "rotated 180 degrees", reference.rotate_half),
        ("transpose", "transposed (row i of the result is column i of the grid)", reference.transpose),
        ("flip_rows", "mirrored left to right (every row reversed)", reference.flip_rows),
        ("flip_columns", "mirrored top to bottom (the order of the rows reversed)", reference.flip_columns),
    ]
    for name, what, solution in variants:
        yield _Draft(
            name,
            name,
            f"Write a function `{name}(grid)` that takes a non-empty rectangular grid (a list of equally "
            f"long, non-empty lists) and returns a new grid: the input {what}.",
            specialize(solution, name),
            lambda rng: (_grid(rng),),
            (([[1]],), ([[1, 2, 3]],)),
        )


def _roman() -> Iterator[_Draft]:
    yield _Draft(
        "upper",
        "to_roman",
        "Write a function `to_roman(n)` that returns the Roman numeral of 1 <= n <= 3999 in upper case, "
        'in the usual subtractive form (4 = "IV", 9 = "IX", 40 = "XL", 1994 = "MCMXCIV").',
        specialize(reference.to_roman, LOWER_CASE=False),
        lambda rng: (rng.randint(1, 3999),),
        ((1,), (4,), (3999,)),
    )
    yield _Draft(
        "lower",
        "to_roman",
        "Write a function `to_roman(n)` that returns the Roman numeral of 1 <= n <= 3999 in lower case, "
        'in the usual subtractive form (4 = "iv", 9 = "ix", 40 = "xl", 1994 = "mcmxciv").',
        specialize(reference.to_roman, LOWER_CASE=True),
        lambda rng: (rng.randint(1, 3999),),
        ((1,), (49,), (3888,)),
    )
    yield _Draft(
        "parse",
        "from_roman",
        "Write a function `from_roman(s)` that returns the value of the upper-case Roman numeral `s` "
        '(a valid numeral in the usual subtractive form, 1 to 3999; "MCMXCIV" = 1994).',
        specialize(reference.from_roman),
        lambda rng: (_roman_of(rng.randint(1, 3999)),),
        (("I",), ("IV",), ("MMMCMXCIX",)),
    )


def _roman_of(n: int) -> str:
    out = []
    for value, letters in reference.ROMAN_NUMERALS:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)


def _nested(rng: random.Random, depth: int = 0) -> list[Any]:
    items: list[Any] = []
    for _ in range(rng.randint(0, 4)):
        items.append(_nested(rng, depth + 1) if depth < 3 and rng.random() < 0.35 else rng.randint(0, 9))
    return items


def _flatten() -> Iterator[_Draft]:
    variants = [
        ("1", 1, "one level: lists directly inside `nested` are replaced by their elements"),
        ("2", 2, "two levels: like flattening one level, done twice"),
        ("all", None, "completely: the result holds only the numbers, in order"),
    ]
    for key, depth, what in variants:
        yield _Draft(
            key,
            "flatten",
            "Write a function `flatten(nested)` that takes a list whose elements are integers or lists "
            f"(nested to any depth) and returns a new list flattened {what}.",
            specialize(reference.flatten, MAX_DEPTH=depth),
            lambda rng: (_nested(rng),),
            (([],), ([[[1]], 2, [3, [4, [5]]]],)),
        )


def _window_sums() -> Iterator[_Draft]:
    for k in range(1, 9):
        yield _Draft(
            str(k),
            "max_window_sum",
            f"Write a function `max_window_sum(xs)` that returns the largest sum of "
            f"{_plural(k, 'consecutive element')} of the list of integers `xs`, or None if `xs` has fewer "
            f"than {_plural(k, 'element')}.",
            specialize(reference.max_window_sum, WINDOW=k),
            lambda rng: (_ints(rng, -20, 20, (0, 14)),),
            (([],), ([5] * k,)),
        )
    yield _Draft(
        "kadane",
        "max_subarray",
        "Write a function `max_subarray(xs)` that returns the largest sum of a non-empty run of "
        "consecutive elements of the non-empty list of integers `xs`.",
        specialize(reference.max_subarray),
        lambda rng: (_ints(rng, -20, 20, (1, 14)),),
        (([-3],), ([-2, -1, -5],)),
    )


def _common_affix() -> Iterator[_Draft]:
    for side, solution in (("prefix", reference.common_prefix), ("suffix", reference.common_suffix)):
        yield _Draft(
            side,
            f"common_{side}",
            f"Write a function `common_{side}(words)` that returns the longest string that is a {side} of "
            'every string in the list `words` ("" for an empty list).',
            specialize(solution),
            lambda rng: (_affixed_words(rng),),
            (([],), (["same", "same"],), (["a", ""],)),
        )


def _affixed_words(rng: random.Random) -> list[str]:
    stem = _word(rng, "ab", (0, 4))
    return [
        rng.choice([stem + _word(rng, "abc", (0, 3)), _word(rng, "abc", (0, 3)) + stem])
        for _ in range(rng.randint(1, 5))
    ]


def _dedupe() -> Iterator[_Draft]:
    variants = [
        (
            "first",
            "keeps the first occurrence of every value (in order) and drops later repeats",
            reference.dedupe_first,
        ),
        (
            "last",
            "keeps the last occurrence of every value and drops earlier ones, preserving the order of the "
            "kept elements",
            reference.dedupe_last,
        ),
        ("unique", "keeps, in order, only the values that occur exactly once", reference.dedupe_unique),
    ]
    for key, what, solution in variants:
        yield _Draft(
            key,
            "dedupe",
            f"Write a function `dedupe(xs)` that returns a new list built from the list of integers `xs`: "
            f"it {what}.",
            specialize(solution, "dedupe"),
            lambda rng: (_ints(rng, 0, 6, (0, 12)),),
            (([],), ([1, 1, 1],)),
        )


def _case_convert() -> Iterator[_Draft]:
    variants = [
        ("snake_to_camel", '"hello_big_world" -> "helloBigWorld"', reference.snake_to_camel, "_"),
        ("snake_to_pascal", '"hello_big_world" -> "HelloBigWorld"', reference.snake_to_pascal, "_"),
        (
            "camel_to_snake",
            '"helloBigWorld" -> "hello_big_world" (every upper-case letter starts a new word)',
            reference.camel_to_snake,
            "camel",
        ),
        ("kebab_to_snake", '"hello-big-world" -> "hello_big_world"', reference.kebab_to_snake, "-"),
    ]
    for name, example, solution, style in variants:
        yield _Draft(
            name,
            name,
            f"Write a function `{name}(s)` that converts an identifier made of lower-case words: {example}.",
            specialize(solution, name),
            functools.partial(_one_arg, _identifier, style),
            (),
        )


def _identifier(rng: random.Random, style: str) -> str:
    words = [_word(rng, "abcdefgh", (1, 5)) for _ in range(rng.randint(1, 4))]
    if style == "camel":
        return words[0] + "".join(w.capitalize() for w in words[1:])
    return style.join(words)


def _search_sorted() -> Iterator[_Draft]:
    variants = [
        (
            "first_index",
            "the index of the first element equal to `x`, or -1 if there is none",
            reference.first_index,
        ),
        (
            "last_index",
            "the index of the last element equal to `x`, or -1 if there is none",
            reference.last_index,
        ),
        ("count_equal", "how many elements equal `x`", reference.count_equal),
        (
            "insertion_point",
            "the number of elements smaller than `x` (where `x` would be inserted before any equal ones)",
            reference.insertion_point,
        ),
    ]
    for name, what, solution in variants:
        yield _Draft(
            name,
            name,
            f"Write a function `{name}(xs, x)` that, for a list of integers `xs` sorted in non-decreasing "
            f"order, returns {what}.",
            specialize(solution, name),
            lambda rng: (sorted(_ints(rng, 0, 12, (0, 12))), rng.randint(-1, 13)),
            (([], 3), ([2, 2, 2], 2)),
        )


def _anagram_groups() -> Iterator[_Draft]:
    for minimum in (1, 2, 3):
        yield _Draft(
            str(minimum),
            "anagram_groups",
            "Write a function `anagram_groups(words)` that groups the distinct strings of the list `words` "
            "into sets of anagrams (the same letters the same number of times, case-sensitive) and returns "
            f"the groups with at least {minimum} word{'s' if minimum > 1 else ''}: each group as a sorted "
            "list, and the list of groups sorted.",
            specialize(reference.anagram_groups, MIN_GROUP=minimum),
            lambda rng: (_anagram_words(rng),),
            (([],), (["ab", "ba", "ab"],)),
        )


def _anagram_words(rng: random.Random) -> list[str]:
    bases = [_word(rng, "abcd", (2, 4)) for _ in range(rng.randint(1, 3))]
    return ["".join(rng.sample(base, len(base))) for base in bases for _ in range(rng.randint(1, 4))]


def _pascal_row() -> Iterator[_Draft]:
    for modulus in (2, 3, 5, 7, 10, 11, 1000, 10**9 + 7):
        yield _Draft(
            str(modulus),
            "pascal_row",
            f"Write a function `pascal_row(n)` that returns row `n` (n >= 0; row 0 is [1]) of Pascal's "
            f"triangle as a list, with every entry taken modulo {modulus}.",
            specialize(reference.pascal_row, MODULUS=modulus),
            lambda rng: (rng.randint(2, 60),),
            ((0,), (1,)),
        )


def _lattice_points() -> Iterator[_Draft]:
    norms = [
        ("euclid", "x*x + y*y", "r*r", reference.lattice_points_euclid),
        ("manhattan", "|x| + |y|", "r", reference.lattice_points_manhattan),
        ("chebyshev", "max(|x|, |y|)", "r", reference.lattice_points_chebyshev),
    ]
    for key, shown, bound, solution in norms:
        for strict in (False, True):
            compare = "<" if strict else "<="
            yield _Draft(
                f"{key}-{'strict' if strict else 'closed'}",
                "lattice_points",
                f"Write a function `lattice_points(r)` that returns how many points (x, y) with integer "
                f"coordinates satisfy {shown} {compare} {bound.replace('*', ' * ')} for the integer r >= 0.",
                specialize(solution, "lattice_points", STRICT=strict),
                lambda rng: (rng.randint(1, 60),),
                ((0,), (1,)),
            )


def _longest_run() -> Iterator[_Draft]:
    for tie in ("first", "last"):
        yield _Draft(
            tie,
            "longest_run",
            "Write a function `longest_run(s)` that returns [character, length] for the longest run of "
            "equal consecutive characters in the non-empty string `s`; when several runs are equally long, "
            f"the {tie} one counts.",
            specialize(reference.longest_run, LAST_WINS=tie == "last"),
            lambda rng: ("".join(rng.choice("xyz") * rng.randint(1, 4) for _ in range(rng.randint(1, 6))),),
            (("a",), ("aabb",)),
        )


def _spiral() -> Iterator[_Draft]:
    for direction, first_move in (
        ("clockwise", "right along the top row"),
        ("counterclockwise", "down the left column"),
    ):
        yield _Draft(
            direction,
            "spiral",
            "Write a function `spiral(grid)` that returns the values of the non-empty rectangular grid (a "
            f"list of equally long non-empty lists) in {direction} spiral order, starting at the top-left "
            f"corner and moving first {first_move}.",
            specialize(reference.spiral, CLOCKWISE=direction == "clockwise"),
            lambda rng: (_grid(rng),),
            (([[1]],), ([[1, 2], [3, 4]],)),
        )


def _look_and_say() -> Iterator[_Draft]:
    for times in range(1, 5):
        yield _Draft(
            str(times),
            "look_and_say",
            f"Write a function `look_and_say(s)` that applies the look-and-say step {times} time"
            f"{'s' if times > 1 else ''} to the non-empty digit string `s`: one step reads the runs of equal "
            "digits from left to right and writes, for each run, its length followed by the digit "
            '("1211" -> "111221").',
            specialize(reference.look_and_say, TIMES=times),
            lambda rng: (_text(rng, "1223", (1, 8)),),
            (("1",), ("1211",)),
        )


def _count_vowels() -> Iterator[_Draft]:
    for vowels in ("aeiou", "aeiouy"):
        for any_case in (True, False):
            rule = "in either case" if any_case else "in lower case only (upper-case letters do not count)"
            yield _Draft(
                f"{vowels}-{'any' if any_case else 'lower'}",
                "count_vowels",
                f"Write a function `count_vowels(s)` that returns how many characters of `s` are one of the "
                f"letters {', '.join(vowels)} {rule}.",
                specialize(reference.count_vowels, VOWELS=vowels, ANY_CASE=any_case),
                lambda rng: (_text(rng, "aeiouyAEIOUYbcdxz .", (0, 25)),),
                (("",), ("YAy",)),
            )


def _leap_years() -> Iterator[_Draft]:
    calendars = [
        (
            "gregorian",
            "Gregorian (divisible by 4, except centuries not divisible by 400)",
            reference.leap_years_gregorian,
        ),
        ("julian", "Julian (every year divisible by 4)", reference.leap_years_julian),
    ]
    for key, rule, solution in calendars:
        yield _Draft(
            key,
            "leap_years",
            f"Write a function `leap_years(first, last)` that returns how many leap years of the {rule} "
            "calendar lie between the years `first` and `last` inclusive (1 <= first <= last).",
            specialize(solution, "leap_years"),
            lambda rng: tuple(sorted((rng.randint(1, 2500), rng.randint(1, 2500)))),
            ((1900, 1900), (2000, 2000), (1, 4)),
        )


def _divisor_classes() -> Iterator[_Draft]:
    classes = [
        ("abundant", "greater than", reference.count_abundant),
        ("perfect", "equal to", reference.count_perfect),
        ("deficient", "less than", reference.count_deficient),
    ]
    for name, relation, solution in classes:
        yield _Draft(
            name,
            f"count_{name}",
            f"Write a function `count_{name}(n)` that returns how many integers m from 1 to `n` are {name}: "
            f"the sum of the divisors of m smaller than m is {relation} m.",
            specialize(solution),
            lambda rng: (rng.randint(1, 400),),
            ((1,), (6,), (12,)),
        )


def _rotate_list() -> Iterator[_Draft]:
    for direction, solution in (("left", reference.rotate_left), ("right", reference.rotate_right)):
        for k in range(1, 6):
            yield _Draft(
                f"{direction}-{k}",
                f"rotate_{direction}",
                f"Write a function `rotate_{direction}(xs)` that returns a new list: the list `xs` rotated "
                f"{direction} by {_plural(k, 'place')} (elements that fall off one end come back at the "
                "other; an empty list stays empty).",
                specialize(solution, PLACES=k),
                lambda rng: (_ints(rng, 0, 9, (0, 9)),),
                (([],), ([7],)),
            )


def _chunks() -> Iterator[_Draft]:
    for size in range(1, 7):
        yield _Draft(
            str(size),
            "chunks",
            "Write a function `chunks(xs)` that splits the list `xs` into consecutive pieces of "
            f"{_plural(size, 'element')} (the last piece may be shorter) and returns the list of pieces.",
            specialize(reference.chunks, CHUNK_SIZE=size),
            lambda rng: (_ints(rng, 0, 9, (0, 15)),),
            (([],),),
        )


def _sorted_checks() -> Iterator[_Draft]:
    variants = [
        ("non_decreasing", "each element is >= the one before it", reference.is_non_decreasing),
        ("strictly_increasing", "each element is > the one before it", reference.is_strictly_increasing),
        ("non_increasing", "each element is <= the one before it", reference.is_non_increasing),
        ("strictly_decreasing", "each element is < the one before it", reference.is_strictly_decreasing),
    ]
    for name, rule, solution in variants:
        yield _Draft(
            name,
            f"is_{name}",
            f"Write a function `is_{name}(xs)` that returns True if, in the list of integers `xs`, {rule} "
            "(an empty or one-element list qualifies), and False otherwise.",
            specialize(solution),
            lambda rng: (
                sorted(_ints(rng, 0, 5, (0, 7)), reverse=rng.random() < 0.5)
                if rng.random() < 0.6
                else _ints(rng, 0, 5, (0, 7)),
            ),
            (([],), ([3, 3],)),
        )


def _perfect_powers() -> Iterator[_Draft]:
    for k in range(2, 7):
        powers = {2: "squares", 3: "cubes"}.get(k, f"{k}th powers")
        yield _Draft(
            str(k),
            "count_powers",
            f"Write a function `count_powers(n)` that returns how many integers from 1 to `n` (inclusive) "
            f"are perfect {powers} (m ** {k} for an integer m >= 1). For n < 1 the answer is 0.",
            specialize(reference.count_powers, POWER=k),
            lambda rng: (rng.randint(1, 10**9),),
            ((0,), (1,), (2**k,), (2**k - 1,)),
        )


def _polygonal() -> Iterator[_Draft]:
    names = {3: "triangular", 4: "square", 5: "pentagonal", 6: "hexagonal", 7: "heptagonal", 8: "octagonal"}
    for sides, name in names.items():
        yield _Draft(
            str(sides),
            f"is_{name}",
            f"Write a function `is_{name}(n)` that returns True if the integer `n` is "
            f"{'an' if name[0] in 'aeiou' else 'a'} {name} number, one of "
            f"P(k) = {_polygonal_formula(sides)} for an integer k >= 1, and False otherwise.",
            specialize(reference.is_polygonal, f"is_{name}", SIDES=sides),
            functools.partial(_one_arg, _polygonal_or_not, sides),
            ((1,), (sides,), (0,)),
        )


def _polygonal_formula(sides: int) -> str:
    a, b = sides - 2, sides - 4
    linear = "" if b == 0 else f" - {b} * k" if b > 0 else f" + {-b} * k"
    return f"({a} * k * k{linear}) // 2"


def _polygonal_or_not(rng: random.Random, sides: int) -> int:
    if rng.random() < 0.5:  # half the tests are members, or "always False" would pass most of them
        k = rng.randint(1, 30)
        return ((sides - 2) * k * k - (sides - 4) * k) // 2
    return rng.randint(-2, 3000)


def _interleave() -> Iterator[_Draft]:
    for key, rule in (
        ("stop", "stopping when the shorter string runs out"),
        ("rest", "until the shorter string runs out, then the rest of the longer one"),
    ):
        yield _Draft(
            key,
            "interleave",
            f"Write a function `interleave(a, b)` that returns the characters of the strings `a` and `b` "
            f'alternately, starting with a\'s first character, {rule} ("abc", "XY" -> '
            f'"{"aXbY" if key == "stop" else "aXbYc"}").',
            specialize(reference.interleave, KEEP_REST=key == "rest"),
            lambda rng: (_word(rng, "abc", (0, 6)), _word(rng, "XYZ", (0, 6))),
            (("", "XY"),),
        )


def _reverse_words() -> Iterator[_Draft]:
    variants = [
        ("order", "the words of `text` in reverse order", reference.reverse_word_order),
        (
            "letters",
            "every word of `text` with its letters reversed, the words kept in order",
            reference.reverse_word_letters,
        ),
        (
            "both",
            "the words in reverse order, each with its letters reversed",
            reference.reverse_words_and_letters,
        ),
    ]
    for key, what, solution in variants:
        yield _Draft(
            key,
            "reverse_words",
            f"Write a function `reverse_words(text)` that splits `text` on whitespace and returns {what}, "
            "joined by single spaces.",
            specialize(solution, "reverse_words"),
            lambda rng: (" ".join(_word(rng, "abcdef", (1, 5)) for _ in range(rng.randint(0, 6))),),
            (("",), ("  one  two ",)),
        )


def _diagonals() -> Iterator[_Draft]:
    variants = [
        ("main", "the main diagonal (top-left to bottom-right)", reference.main_diagonal_sum),
        ("anti", "the anti-diagonal (top-right to bottom-left)", reference.anti_diagonal_sum),
        (
            "both",
            "both diagonals (the centre cell of an odd-sized grid counted once)",
            reference.both_diagonals_sum,
        ),
    ]
    for key, what, solution in variants:
        yield _Draft(
            key,
            "diagonal_sum",
            f"Write a function `diagonal_sum(grid)` that returns the sum of the cells on {what} of the "
            "non-empty square grid `grid` (a list of n lists of n integers).",
            specialize(solution, "diagonal_sum"),
            lambda rng: (
                [
                    [rng.randint(-9, 9) for _ in range(side)]
                    for side in [rng.randint(1, 6)]
                    for _ in range(side)
                ],
            ),
            (([[5]],),),
        )


FAMILIES: tuple[Callable[[], Iterator[_Draft]], ...] = (
    _sum_multiples,
    _count_digit,
    _digits_at_least,
    _caesar,
    _fizzbuzz,
    _palindrome,
    _run_length,
    _recurrence,
    _digit_power_sum,
    _base_digit_sum,
    _count_with_divisors,
    _reduce_numbers,
    _kth_value,
    _word_counts,
    _balanced,
    _collatz,
    _merge_intervals,
    _grid_transform,
    _roman,
    _flatten,
    _window_sums,
    _common_affix,
    _dedupe,
    _case_convert,
    _search_sorted,
    _anagram_groups,
    _pascal_row,
    _lattice_points,
    _longest_run,
    _spiral,
    _look_and_say,
    _count_vowels,
    _leap_years,
    _divisor_classes,
    _rotate_list,
    _chunks,
    _sorted_checks,
    _perfect_powers,
    _polygonal,
    _interleave,
    _reverse_words,
    _diagonals,
)


def _build(family: str, draft: _Draft) -> Problem:
    problem_id = f"{family}-{draft.key}"
    rng = random.Random(f"code-tests:{problem_id}")
    inputs: list[Args] = []
    for args in draft.fixed:
        if args not in inputs:
            inputs.append(args)
    seen = {canonical(list(args)) for args in inputs}
    attempts = 0
    while len(inputs) < TESTS_PER_PROBLEM and attempts < 200:
        args = draft.make_input(rng)
        attempts += 1
        if canonical(list(args)) not in seen:  # distinct tests: a repeat would test nothing new
            seen.add(canonical(list(args)))
            inputs.append(args)
    # The tests reach the sandbox as JSON: expected values come from the arguments as they arrive there.
    arrived = [tuple(json.loads(canonical(list(args)))) for args in inputs]
    namespace: dict[str, Any] = {}
    exec(compile(draft.solution, f"<{problem_id}>", "exec"), namespace)  # our own reference, not model output
    reference = namespace[draft.function]
    expected = tuple(canonical(reference(*copy.deepcopy(args))) for args in arrived)
    return Problem(problem_id, draft.function, draft.statement, draft.solution, tuple(arrived), expected)


@functools.cache
def all_problems() -> tuple[Problem, ...]:
    """Every problem, in a fixed order (family by family)."""
    problems: list[Problem] = []
    for family in FAMILIES:
        name = family.__name__.lstrip("_")
        problems.extend(_build(name, draft) for draft in family())
    return tuple(problems)


@functools.cache
def problems(split: str = "all") -> tuple[Problem, ...]:
    """The problems of ``split``: "all", "train" (four in five) or "test" (the fifth, held out)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return tuple(p for p in all_problems() if split == "all" or p.split() == split)
