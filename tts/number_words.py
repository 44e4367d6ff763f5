"""Numbers read aloud: digits, cardinals, ordinals, years, written numbers and fractions (num2words, imported on
use), for the normaliser's rules (`tts.normalize_rules`)."""

from __future__ import annotations

import re

from tts.normalize_tables import FRACTION_NAMES

LONGEST_NUMBER = 15  # digits; longer runs are read digit by digit (num2words overflows near 10**306)


def _num2words(number: int, **kwargs) -> str:
    from num2words import num2words  # imported on use: training on the GPU needs only the unit table

    return re.sub(r",| and\b", "", num2words(number, **kwargs))


def digits(text: str, zero: str = "zero") -> str:
    """ "4607" -> "four six zero seven" (``zero="oh"`` for phone numbers)."""
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    return " ".join(zero if d == "0" else names[int(d)] for d in text if d.isdigit())


def cardinal(number: int) -> str:
    if number < 0:
        return f"minus {cardinal(-number)}"
    if len(str(number)) > LONGEST_NUMBER:
        return digits(str(number))
    return _num2words(number)


def ordinal(number: int) -> str:
    if len(str(number)) > LONGEST_NUMBER:
        return digits(str(number))
    return _num2words(number, to="ordinal")


def year(number: int) -> str:
    """1990 -> nineteen ninety, 2005 -> two thousand five, 1905 -> nineteen oh-five."""
    return _num2words(number, to="year") if 1000 <= number <= 2099 else cardinal(number)


_NUMBER = re.compile(r"(?P<sign>[-+]?)(?P<int>\d{1,3}(?:,\d{3})+|\d*)(?:\.(?P<frac>\d+))?")


def number(text: str, years: bool = False) -> str | None:
    """A written number, or None: "-1,234.50" -> minus one thousand two hundred thirty-four point five zero.
    ``years``: a bare four-digit integer from 1000 to 2099 is read as a year."""
    match = _NUMBER.fullmatch(text)
    if not match or not (match.group("int") or match.group("frac")):
        return None
    sign = {"-": "minus ", "+": "plus "}[match.group("sign")] if match.group("sign") else ""
    whole, frac = match.group("int").replace(",", ""), match.group("frac")
    if not whole:
        said = ""
    elif len(whole) > 1 and whole.startswith("0"):
        said = digits(whole)
    elif years and not frac and "," not in match.group("int") and len(whole) == 4 and 1000 <= int(whole) <= 2099:
        said = year(int(whole))
    else:
        said = cardinal(int(whole))
    if frac:
        said = f"{said} point {digits(frac)}".strip()
    return sign + said


def counted_amount(text: str) -> tuple[str, bool] | None:
    """A number to count things with: (words, plural?). "1" -> ("one", False), "1.5" -> (..., True)."""
    said = number(text)
    if said is None:
        return None
    return said, text.lstrip("+-").replace(",", "") not in ("1", "1.0")


def fraction(numerator: int, denominator: int) -> str | None:
    if not (2 <= denominator <= 16 or denominator in (32, 64, 100, 1000)) or numerator > 10 * denominator:
        return None
    one, many = FRACTION_NAMES.get(denominator, (ordinal(denominator), ordinal(denominator) + "s"))
    return f"{cardinal(numerator)} {one if numerator == 1 else many}"
