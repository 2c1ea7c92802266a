"""The reference solutions of ``code-tests`` as checked code: a typed function per family, or per
variant where a family's variants are different algorithms.

A family's parameters (the divisors of a FizzBuzz, the shift of a Caesar cipher...) are the
module-level names in capitals that its function reads. ``specialize.specialize`` writes a variant's
values in their place and returns the source text that ``problems`` runs to compute the expected
answers and shows as the gold solution. The values given here are one variant's, so every function
also runs as written. ``Final`` names are constants, written into every variant as they are.

The text runs on its own in the sandbox's Python (3.9 at the least): a function imports what it needs
inside itself, reads no other module-level name, and uses nothing newer (``zip(strict=)``,
``itertools.pairwise``: 3.10).
"""

# ruff: noqa: B905, RUF007 - the sources run on the sandbox's Python, 3.9 at the least: no zip(strict=),
# no itertools.pairwise
from __future__ import annotations

from typing import Any, Final

# --- sum_multiples, fizzbuzz: the two divisors, and the words fizzbuzz says for their multiples ----

DIVISOR_A = 3
DIVISOR_B = 5
WORD_A = "Fizz"
WORD_B = "Buzz"


def sum_multiples(n: int) -> int:
    return sum(k for k in range(1, n) if k % DIVISOR_A == 0 or k % DIVISOR_B == 0)


def fizzbuzz(n: int) -> list[str]:
    out: list[str] = []
    for k in range(1, n + 1):
        if k % DIVISOR_A == 0 and k % DIVISOR_B == 0:
            out.append(WORD_A + WORD_B)
        elif k % DIVISOR_A == 0:
            out.append(WORD_A)
        elif k % DIVISOR_B == 0:
            out.append(WORD_B)
        else:
            out.append(str(k))
    return out


# --- digits: the digit counted (a string), the smallest digit counted, the power, the base --------

DIGIT = "0"
MIN_DIGIT = 1
POWER = 1
BASE = 2


def count_digit(n: int) -> int:
    return str(n).count(DIGIT)


def digits_at_least(n: int) -> int:
    return sum(1 for c in str(n) if int(c) >= MIN_DIGIT)


def digit_power_sum(n: int) -> int:
    return sum(int(c) ** POWER for c in str(n))


def base_digit_sum(n: int) -> int:
    total = 0
    while n:
        total += n % BASE
        n //= BASE
    return total


# --- caesar ----------------------------------------------------------------------------------------

SHIFT = 1


def caesar(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - 97 + SHIFT) % 26 + 97))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - 65 + SHIFT) % 26 + 65))
        else:
            out.append(ch)
    return "".join(out)


# --- is_palindrome ---------------------------------------------------------------------------------


def is_palindrome_exact(s: str) -> bool:
    return s == s[::-1]


def is_palindrome_ignoring_case(s: str) -> bool:
    t = s.lower()
    return t == t[::-1]


def is_palindrome_alnum(s: str) -> bool:
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]


# --- run_length: "char-count", "count-char" or "omit-one" ----------------------------------------

RUN_FORMAT = "char-count"


def run_length(s: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        ch, n = s[i], j - i
        if RUN_FORMAT == "count-char":
            out.append(str(n) + ch)
        elif RUN_FORMAT == "omit-one":
            out.append(ch + (str(n) if n > 1 else ""))
        else:  # "char-count"
            out.append(ch + str(n))
        i = j
    return "".join(out)


# --- term (a Fibonacci-like recurrence), pascal_row: the start values, the modulus ----------------

FIRST = 0
SECOND = 1
MODULUS = 1000


def term(n: int) -> int:
    a, b = FIRST % MODULUS, SECOND % MODULUS
    for _ in range(n):
        a, b = b, (a + b) % MODULUS
    return a


def pascal_row(n: int) -> list[int]:
    row = [1]
    for _ in range(n):
        row = [1, *[row[i] + row[i + 1] for i in range(len(row) - 1)], 1]
    return [v % MODULUS for v in row]


# --- counting by divisors --------------------------------------------------------------------------

DIVISOR_COUNT = 1


def count_with_divisors(n: int) -> int:
    def divisors(m: int) -> int:
        count, d = 0, 1
        while d * d <= m:
            if m % d == 0:
                count += 1 if d * d == m else 2
            d += 1
        return count

    return sum(1 for m in range(1, n + 1) if divisors(m) == DIVISOR_COUNT)


def count_abundant(n: int) -> int:
    return sum(1 for m in range(1, n + 1) if sum(d for d in range(1, m) if m % d == 0) > m)


def count_perfect(n: int) -> int:
    return sum(1 for m in range(1, n + 1) if sum(d for d in range(1, m) if m % d == 0) == m)


def count_deficient(n: int) -> int:
    return sum(1 for m in range(1, n + 1) if sum(d for d in range(1, m) if m % d == 0) < m)


# --- one number from a list ------------------------------------------------------------------------


def gcd_all(xs: list[int]) -> int:
    import math

    g = 0
    for x in xs:
        g = math.gcd(g, x)
    return g


def lcm_all(xs: list[int]) -> int:
    import math

    m = 1
    for x in xs:
        m = m * x // math.gcd(m, x)
    return m


def spread(xs: list[int]) -> int:
    return max(xs) - min(xs)


def sum_squares(xs: list[int]) -> int:
    return sum(x * x for x in xs)


def product_mod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p = p * x % 1000003
    return p


def distinct_count(xs: list[int]) -> int:
    return len(set(xs))


def odd_sum(xs: list[int]) -> int:
    return sum(x for x in xs if x % 2)


def max_abs(xs: list[int]) -> int:
    return max(abs(x) for x in xs)


# --- kth_largest, kth_smallest ---------------------------------------------------------------------

K = 1
LARGEST = True


def kth_value(xs: list[int]) -> int | None:
    values = sorted(set(xs), reverse=LARGEST)
    return values[K - 1] if len(values) >= K else None


# --- word_counts -----------------------------------------------------------------------------------

MIN_COUNT = 1
LOWERCASE = True


def word_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for word in text.split():
        if LOWERCASE:
            word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return {w: c for w, c in counts.items() if c >= MIN_COUNT}


# --- balanced: each closing bracket mapped to its opening one --------------------------------------

CLOSING = {")": "("}


def balanced(s: str) -> bool:
    closing = CLOSING
    opening = set(closing.values())
    stack: list[str] = []
    for ch in s:
        if ch in opening:
            stack.append(ch)
        elif ch in closing and (not stack or stack.pop() != closing[ch]):
            return False
    return not stack


# --- collatz: "steps", "peak", "odd" or "length" ---------------------------------------------------

COLLATZ_RESULT = "steps"


def collatz(n: int) -> int:
    steps, peak, odd = 0, n, 1 if n % 2 else 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
        peak = max(peak, n)
        odd += n % 2
    if COLLATZ_RESULT == "steps":
        return steps
    elif COLLATZ_RESULT == "peak":
        return peak
    elif COLLATZ_RESULT == "odd":
        return odd
    else:  # "length"
        return steps + 1


# --- merge_intervals: whether touching intervals merge; "list", "count" or "length" ----------------

TOUCHING = True
MERGED_RESULT = "list"


def merge_intervals(intervals: list[list[int]]) -> list[list[int]] | int:
    merged: list[list[int]] = []
    for s, e in sorted(intervals):
        if merged and (s <= merged[-1][1] if TOUCHING else s < merged[-1][1]):
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    if MERGED_RESULT == "count":
        return len(merged)
    elif MERGED_RESULT == "length":
        return sum(e - s for s, e in merged)
    else:  # "list"
        return [list(x) for x in merged]


# --- grids ------------------------------------------------------------------------------------------

CLOCKWISE = True


def rotate_cw(grid: list[list[int]]) -> list[list[int]]:
    return [list(row) for row in zip(*grid[::-1])]


def rotate_ccw(grid: list[list[int]]) -> list[list[int]]:
    return [list(row) for row in zip(*grid)][::-1]


def rotate_half(grid: list[list[int]]) -> list[list[int]]:
    return [row[::-1] for row in grid[::-1]]


def transpose(grid: list[list[int]]) -> list[list[int]]:
    return [list(row) for row in zip(*grid)]


def flip_rows(grid: list[list[int]]) -> list[list[int]]:
    return [row[::-1] for row in grid]


def flip_columns(grid: list[list[int]]) -> list[list[int]]:
    return [list(row) for row in grid[::-1]]


def spiral(grid: list[list[int]]) -> list[int]:
    g = [list(r) for r in grid] if CLOCKWISE else [list(r) for r in zip(*grid)]
    out: list[int] = []
    while g:
        out.extend(g.pop(0))
        g = [list(r) for r in zip(*g)][::-1]
    return out


def main_diagonal_sum(grid: list[list[int]]) -> int:
    n = len(grid)
    return sum(grid[i][i] for i in range(n))


def anti_diagonal_sum(grid: list[list[int]]) -> int:
    n = len(grid)
    return sum(grid[i][n - 1 - i] for i in range(n))


def both_diagonals_sum(grid: list[list[int]]) -> int:
    n = len(grid)
    centre = grid[n // 2][n // 2] if n % 2 else 0  # on both diagonals: counted once
    return sum(grid[i][i] + grid[i][n - 1 - i] for i in range(n)) - centre


# --- Roman numerals --------------------------------------------------------------------------------

ROMAN_NUMERALS: Final = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]  # fmt: skip
LOWER_CASE = False


def to_roman(n: int) -> str:
    out: list[str] = []
    for value, letters in ROMAN_NUMERALS:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out).lower() if LOWER_CASE else "".join(out)


def from_roman(s: str) -> int:
    n = 0
    for value, letters in ROMAN_NUMERALS:
        while s.startswith(letters):
            n += value
            s = s[len(letters) :]
    return n


# --- flatten: how many levels (None: all of them) --------------------------------------------------

MAX_DEPTH: int | None = 1


def flatten(nested: list[Any]) -> list[Any]:
    def go(items: list[Any], depth: int) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if MAX_DEPTH is None:
                deeper = isinstance(item, list)
            else:
                deeper = isinstance(item, list) and depth < MAX_DEPTH
            if deeper:
                out.extend(go(item, depth + 1))
            else:
                out.append(item)
        return out

    return go(nested, 0)


# --- runs of a list --------------------------------------------------------------------------------

WINDOW = 1


def max_window_sum(xs: list[int]) -> int | None:
    if len(xs) < WINDOW:
        return None
    return max(sum(xs[i : i + WINDOW]) for i in range(len(xs) - WINDOW + 1))


def max_subarray(xs: list[int]) -> int:
    best = current = xs[0]
    for x in xs[1:]:
        current = max(x, current + x)
        best = max(best, current)
    return best


# --- common_prefix, common_suffix ------------------------------------------------------------------


def common_prefix(words: list[str]) -> str:
    if not words:
        return ""
    s = min(words, key=len)
    n = len(s)
    while not all(w[:n] == s[:n] for w in words):
        n -= 1
    return s[:n]


def common_suffix(words: list[str]) -> str:
    if not words:
        return ""
    s = min(words, key=len)
    n = len(s)
    while not all(w[len(w) - n :] == s[len(s) - n :] for w in words):
        n -= 1
    return s[len(s) - n :]


# --- dedupe ----------------------------------------------------------------------------------------


def dedupe_first(xs: list[int]) -> list[int]:
    seen: set[int] = set()
    out: list[int] = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def dedupe_last(xs: list[int]) -> list[int]:
    seen: set[int] = set()
    out: list[int] = []
    for x in reversed(xs):
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out[::-1]


def dedupe_unique(xs: list[int]) -> list[int]:
    return [x for x in xs if xs.count(x) == 1]


# --- identifiers -----------------------------------------------------------------------------------


def snake_to_camel(s: str) -> str:
    first, *rest = s.split("_")
    return first + "".join(w.capitalize() for w in rest)


def snake_to_pascal(s: str) -> str:
    return "".join(w.capitalize() for w in s.split("_"))


def camel_to_snake(s: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in s)


def kebab_to_snake(s: str) -> str:
    return s.replace("-", "_")


# --- searching a sorted list -----------------------------------------------------------------------


def first_index(xs: list[int], x: int) -> int:
    for i, v in enumerate(xs):
        if v == x:
            return i
    return -1


def last_index(xs: list[int], x: int) -> int:
    for i in range(len(xs) - 1, -1, -1):
        if xs[i] == x:
            return i
    return -1


def count_equal(xs: list[int], x: int) -> int:
    return xs.count(x)


def insertion_point(xs: list[int], x: int) -> int:
    return sum(1 for v in xs if v < x)


# --- anagram_groups --------------------------------------------------------------------------------

MIN_GROUP = 1


def anagram_groups(words: list[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for w in set(words):
        groups.setdefault("".join(sorted(w)), []).append(w)
    return sorted(sorted(g) for g in groups.values() if len(g) >= MIN_GROUP)


# --- lattice_points: whether the bound is strict ---------------------------------------------------

STRICT = False


def lattice_points_euclid(r: int) -> int:
    return sum(
        1
        for x in range(-r, r + 1)
        for y in range(-r, r + 1)
        if (x * x + y * y < r * r if STRICT else x * x + y * y <= r * r)
    )


def lattice_points_manhattan(r: int) -> int:
    return sum(
        1
        for x in range(-r, r + 1)
        for y in range(-r, r + 1)
        if (abs(x) + abs(y) < r if STRICT else abs(x) + abs(y) <= r)
    )


def lattice_points_chebyshev(r: int) -> int:
    return sum(
        1
        for x in range(-r, r + 1)
        for y in range(-r, r + 1)
        if (max(abs(x), abs(y)) < r if STRICT else max(abs(x), abs(y)) <= r)
    )


# --- strings ---------------------------------------------------------------------------------------

LAST_WINS = False  # longest_run: of equally long runs, the last one counts (else the first)
TIMES = 1
VOWELS = "aeiou"
ANY_CASE = True
KEEP_REST = False  # interleave: the rest of the longer string follows


def longest_run(s: str) -> list[Any] | None:
    best: list[Any] | None = None
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        if best is None or (j - i >= best[1] if LAST_WINS else j - i > best[1]):
            best = [s[i], j - i]
        i = j
    return best


def look_and_say(s: str) -> str:
    for _ in range(TIMES):
        out: list[str] = []
        i = 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i]:
                j += 1
            out.append(str(j - i) + s[i])
            i = j
        s = "".join(out)
    return s


def count_vowels(s: str) -> int:
    return sum(1 for c in (s.lower() if ANY_CASE else s) if c in VOWELS)


def interleave(a: str, b: str) -> str:
    woven = "".join(x + y for x, y in zip(a, b))
    return woven + a[len(b) :] + b[len(a) :] if KEEP_REST else woven


def reverse_word_order(text: str) -> str:
    return " ".join(text.split()[::-1])


def reverse_word_letters(text: str) -> str:
    return " ".join(w[::-1] for w in text.split())


def reverse_words_and_letters(text: str) -> str:
    return " ".join(w[::-1] for w in text.split()[::-1])


# --- leap_years ------------------------------------------------------------------------------------


def leap_years_gregorian(first: int, last: int) -> int:
    return sum(1 for y in range(first, last + 1) if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0))


def leap_years_julian(first: int, last: int) -> int:
    return sum(1 for y in range(first, last + 1) if y % 4 == 0)


# --- lists -----------------------------------------------------------------------------------------

PLACES = 1
CHUNK_SIZE = 1


def rotate_left(xs: list[int]) -> list[int]:
    if not xs:
        return []
    return xs[PLACES % len(xs) :] + xs[: PLACES % len(xs)]


def rotate_right(xs: list[int]) -> list[int]:
    if not xs:
        return []
    return xs[-(PLACES % len(xs)) :] + xs[: -(PLACES % len(xs))] if PLACES % len(xs) else list(xs)


def chunks(xs: list[int]) -> list[list[int]]:
    return [xs[i : i + CHUNK_SIZE] for i in range(0, len(xs), CHUNK_SIZE)]


def is_non_decreasing(xs: list[int]) -> bool:
    return all(b >= a for a, b in zip(xs, xs[1:]))


def is_strictly_increasing(xs: list[int]) -> bool:
    return all(b > a for a, b in zip(xs, xs[1:]))


def is_non_increasing(xs: list[int]) -> bool:
    return all(b <= a for a, b in zip(xs, xs[1:]))


def is_strictly_decreasing(xs: list[int]) -> bool:
    return all(b < a for a, b in zip(xs, xs[1:]))


# --- figurate numbers: the exponent is POWER (above) -----------------------------------------------

SIDES = 3


def count_powers(n: int) -> int:
    m = 0
    while (m + 1) ** POWER <= n:
        m += 1
    return m


def is_polygonal(n: int) -> bool:
    k = 1
    while ((SIDES - 2) * k * k - (SIDES - 4) * k) // 2 < n:
        k += 1
    return ((SIDES - 2) * k * k - (SIDES - 4) * k) // 2 == n
