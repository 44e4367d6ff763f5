"""The rules that read one token of a sentence aloud, looking at its neighbours (the number words: `tts.number_words`).

Each rule is ``rule(ctx, i) -> spoken forms of tokens i, i+1, ... | None``; `first_rule` tries them in
order (the order matters: a date before a range, a unit before a plain number). A rule that reads two
tokens together ("$5 million" -> "five", "million dollars") returns a form for each, so every token keeps
its own spoken form (word timings refer to what was written). The facts are in `tts.normalize_tables`.
"""

from __future__ import annotations

import re
import unicodedata

from tts.normalize_tables import (
    ABBREVIATIONS,
    BEFORE_NUMBER,
    CURRENCIES,
    CURRENCY_CODES,
    MAGNITUDES,
    MONTH_OF,
    MONTHS,
    NONFINAL,
    REGNAL_TITLES,
    ROMAN_CARDINAL_AFTER,
    SPACED_UNITS,
    SPELLED,
    SYMBOL_WORDS,
    TITLES,
    TOP_DOMAINS,
    UNITS,
    URL_SYMBOLS,
    VULGAR_FRACTIONS,
)
from tts.number_words import cardinal, counted_amount, digits, fraction, number, ordinal, year

_LEAD = "\"'([{¿¡“‘«*_"
_TRAIL = "\"')]}”’»*_,;:!?."


def split_token(text: str) -> tuple[str, str, str]:
    """(leading punctuation, core, trailing punctuation). A period that belongs to the core stays:
    "(Dr." -> ("(", "Dr.", ""); "U.S.," -> ("", "U.S.", ","); "end." -> ("", "end", ".")."""
    i, j = 0, len(text)
    while i < j and text[i] in _LEAD:
        i += 1
    while j > i and text[j - 1] in _TRAIL:
        j -= 1
    core, trail = text[i:j], text[j:]
    if trail.startswith(".") and _keeps_period(core):
        core, trail = core + ".", trail[1:]
    if core.startswith("-") and not core[1:2].isdigit() and core.strip("-"):
        core = core.lstrip("-")  # "-word": a dash before a word, not a minus
    return text[:i], core, trail


def _keeps_period(core: str) -> bool:
    low = core.lower()
    return (
        low in TITLES
        or low in ABBREVIATIONS
        or low in BEFORE_NUMBER
        or low in NONFINAL
        or bool(re.fullmatch(r"(?:[A-Za-z]\.)+[A-Za-z]|[A-Za-z]", core))
    )


_CAPS, _TWO_LETTERS = re.compile(r"[A-Z][A-Z']+"), re.compile(r"[A-Za-z]{2}")


class Context:
    """Per-sentence view the rules read: each token's core and its neighbours'."""

    def __init__(self, tokens: list):
        self.tokens = tokens
        parts = [
            split_token(clean(t.text)) if t.kind == "word" and not t.text.startswith("<") else ("", "", "")
            for t in tokens
        ]  # an element's words are its own (`tts.ssml`)
        self.raw = [t.text for t in tokens]
        self.core = [p[1] for p in parts]
        self.trail = [p[2] for p in parts]
        caps = [c for c in self.core if _CAPS.fullmatch(c)]
        words = [c for c in self.core if _TWO_LETTERS.search(c)]
        self.shouting = len(words) >= 3 and len(caps) > 0.6 * len(words)

    def at(self, i: int) -> str:
        return self.core[i] if 0 <= i < len(self.core) else ""


def clean(text: str) -> str:
    """NFKC (but vulgar fractions and ™ read as themselves), curly quotes straight, controls removed."""
    if text.isascii() and text.isprintable():
        return text  # the common case, already clean: NFKC and the table change nothing in printable ASCII
    text = "".join(ch if ch in VULGAR_FRACTIONS or ch in "™" else unicodedata.normalize("NFKC", ch) for ch in text)
    text = text.translate(
        {0x2018: "'", 0x2019: "'", 0x201C: '"', 0x201D: '"', 0x2212: "-", 0x2013: "-", 0x2014: " - ", 0x2044: "/"}
    )
    return "".join(ch for ch in text if unicodedata.category(ch)[0] != "C")


def first_rule(ctx: Context, i: int) -> list[str]:
    """Spoken forms of tokens i, i+1, ...: those of the first rule that reads token i, else its plain form.
    A plain word (`plain_word`) goes straight to its plain form: no rule reads it otherwise."""
    if plain_word(ctx.core[i]):
        return [_plain(ctx.core[i])]
    return by_rules(ctx, i)


def by_rules(ctx: Context, i: int) -> list[str]:
    """`first_rule` without the plain-word shortcut (tests check the two agree)."""
    for rule in _RULES:
        said = rule(ctx, i)
        if said is not None:
            return said
    return [_plain(ctx.core[i])]


# Words of letters that some rule reads: months ("March" 4), titles ("Mr" Li), abbreviations ("vs", "etc"),
# words before a number, symbol names. A rule that claims a word of letters adds it here.
_RULE_WORDS = (
    frozenset(MONTH_OF)
    | frozenset(TITLES)
    | frozenset(ABBREVIATIONS)
    | frozenset(BEFORE_NUMBER)
    | frozenset(SYMBOL_WORDS)
)
_LETTERS = re.compile(r"[^\W\d_]+(?:['-][^\W\d_]+)*'?")
_ROMAN_DIGITS = frozenset("IVXLCDM")


def plain_word(core: str) -> bool:
    """Is this core a word no rule reads: letters only (an apostrophe or a hyphen between them), not in
    _RULE_WORDS and not a Roman numeral? Most words of running text are; they skip the ~20 rules (the rules
    look for digits, symbols, periods, capitals of a numeral or the words above). Examples: "birch",
    "isn't", "well-known" -> True; "March", "IV", "vs", "½", "5kg" -> False."""
    if not _LETTERS.fullmatch(core) or core.lower() in _RULE_WORDS:
        return False
    numeral = core[:-2] if core.endswith("'s") else core
    return not _ROMAN_DIGITS.issuperset(numeral) and core.replace("'", "").replace("-", "").isalpha()


# ---- rules: each (ctx, i) -> spoken forms of tokens i, i+1, ... or None ----------------------------
def _markup_free(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    if not core:
        return [""]
    if re.fullmatch(r"\s*-+\s*", core):
        return [","]  # a dash between words: a pause
    if not re.search(r"[\w$£€¥₹#%&@+=<>~§©®™°×÷±≤≥≈/\\→½⅓⅔¼¾⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞]", core):
        return [""]  # punctuation only: its trailing mark still counts
    return None


def _url(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    email = re.fullmatch(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+", core)
    web = re.fullmatch(r"(?:https?://|www\.)\S+", core, re.I) or re.fullmatch(
        r"[\w-]+(?:\.[\w-]+)*\.(?P<tld>[a-z]{2,6})(?:/\S*)?", core, re.I
    )
    if not email and not (web and (web.groupdict().get("tld") is None or web.group("tld").lower() in TOP_DOMAINS)):
        return None
    address = re.sub(r"^https?://", "", core, flags=re.I).rstrip("/")
    words = []
    for part in re.split(r"([./@:_?=&#~+%-])", address):
        if part in URL_SYMBOLS:
            words.append(URL_SYMBOLS[part])
        elif part.lower() == "www":
            words.append("W.W.W.")
        elif part.isdigit():
            words.append(cardinal(int(part)) if len(part) <= 4 else digits(part))
        elif part:
            words.append(_alnum(part.lower()))
    return [" ".join(words)]


def _phone(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    whole = re.fullmatch(r"(?:\+?(1)[-. ])?\(?(\d{3})\)?[-. ]?(\d{3})[-.](\d{4})", core)
    if whole and ("-" in core or "." in core):
        groups = [g for g in whole.groups() if g]
        prefix = ["one"] if whole.group(1) else []
        return [", ".join(prefix + [digits(g, "oh") for g in groups[1 if prefix else 0 :]])]
    if re.fullmatch(r"\(\d{3}\)", ctx.raw[i]) and re.fullmatch(r"\d{3}-\d{4}", ctx.at(i + 1)):
        return [digits(core, "oh") + ",", ", ".join(digits(g, "oh") for g in ctx.at(i + 1).split("-"))]
    return None


_AMPM = re.compile(r"(?P<ap>[ap])\.?m\.?", re.I)


def _time(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"(\d{1,2}):(\d\d)(?::(\d\d))?(?P<ampm>[ap]\.?m\.?)?", ctx.core[i], re.I) or re.fullmatch(
        r"(\d{1,2})(?:\.(\d\d))?()(?P<ampm>[ap]\.?m\.?)", ctx.core[i], re.I
    )
    dotted = re.fullmatch(r"\d{1,2}\.\d\d", ctx.core[i])
    if dotted and _AMPM.fullmatch(ctx.at(i + 1)):  # "3.45 pm", as ASR transcripts write it
        match = re.fullmatch(r"(\d{1,2})\.(\d\d)()(?P<ampm>)", ctx.core[i])
    if not match:
        return None
    hours, minutes = int(match.group(1)), int(match.group(2) or 0)
    if hours > 24 or minutes > 59:
        return None
    ampm = match.group("ampm")
    following = _AMPM.fullmatch(ctx.at(i + 1)) if not ampm else None
    ampm = ampm or (following and following.group(0))
    said = cardinal(hours)
    if minutes:
        said += f" {'oh ' if minutes < 10 else ''}{cardinal(minutes)}"
    elif not ampm and match.group(2):
        said += " hundred" if hours > 12 or hours == 0 else " o'clock"
    if match.group(3):
        said += f" and {cardinal(int(match.group(3)))} seconds"
    letters = f"{_AMPM.fullmatch(ampm).group('ap').upper()}.M." if ampm else ""
    if following:
        return [said, letters]
    return [f"{said} {letters}".strip()]


def _date(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    iso = re.fullmatch(r"(\d{4})-(\d\d)-(\d\d)", core)
    us = re.fullmatch(r"(\d{1,2})[/-](\d{1,2})[/-](\d{4}|\d\d)", core)
    if iso:
        y, m, d = (int(g) for g in iso.groups())
    elif us:
        m, d, y = (int(g) for g in us.groups())
        y += 2000 if len(us.group(3)) == 2 and y < 50 else 1900 if len(us.group(3)) == 2 else 0
    else:
        return _written_date(ctx, i)
    if not (1 <= m <= 12 and 1 <= d <= 31):
        return None
    return [f"{MONTHS[m - 1]} {ordinal(d)}, {year(y)}"]


def _written_date(ctx: Context, i: int) -> list[str] | None:
    """ "March 4, 2024" -> March fourth, ...; "4 March" -> the fourth of March; "Jan. 4th" -> January fourth."""
    month = MONTH_OF.get(ctx.core[i].rstrip(".").lower())
    day = re.fullmatch(r"(\d{1,2})(?:st|nd|rd|th)?", ctx.at(i + 1))
    if month and day and 1 <= int(day.group(1)) <= 31 and (ctx.core[i][0].isupper()):
        return [MONTHS[month - 1], ordinal(int(day.group(1)))]
    day = re.fullmatch(r"(\d{1,2})(?:st|nd|rd|th)?", ctx.core[i])
    after = ctx.at(i + 1).rstrip(".")
    if day and 1 <= int(day.group(1)) <= 31 and after.lower() in MONTH_OF and after[:1].isupper() and not ctx.trail[i]:
        return [f"the {ordinal(int(day.group(1)))} of"]
    return None


def _money(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    match = re.fullmatch(
        r"(?P<cur>[$£€¥₹₩])(?P<a>\d[\d,]*(?:\.\d+)?)(?P<mag>[kKmMbBtT]n?|mm)?"
        r"(?:-(?P=cur)?(?P<b>\d[\d,]*(?:\.\d+)?)(?P<mag2>[kKmMbBtT]n?)?)?",
        core,
    )
    code = None
    if not match:
        code = re.fullmatch(r"(?P<a>\d[\d,]*(?:\.\d+)?)", core) and CURRENCY_CODES.get(ctx.at(i + 1).lower())
        if not code:
            return None
        return [_money_words(code, core, None), ""]
    cur, mag = match.group("cur"), (match.group("mag") or match.group("mag2") or "").lower()
    following = (
        MAGNITUDES.get(ctx.at(i + 1).lower())
        if not mag and ctx.at(i + 1).lower() in ("thousand", "million", "billion", "trillion")
        else None
    )
    if following:
        amount = number(match.group("a"))
        return [amount, f"{following} {CURRENCIES[cur][1]}"] if amount else None
    if match.group("b"):
        low = number(match.group("a"))
        return [f"{low} to {_money_words(cur, match.group('b'), mag)}"]
    return [_money_words(cur, match.group("a"), mag)]


def _money_words(cur: str, amount: str, magnitude: str | None) -> str:
    one, many, cent, cents = CURRENCIES[cur]
    if magnitude:
        return f"{number(amount)} {MAGNITUDES[magnitude]} {many}"
    whole, _, frac = amount.replace(",", "").partition(".")
    if len(frac) > 2:
        return f"{number(amount)} {many}"
    hundredths = int(frac.ljust(2, "0")) if frac else 0
    parts = []
    if int(whole) or not hundredths:
        parts.append(f"{cardinal(int(whole))} {one if int(whole) == 1 else many}")
    if hundredths:
        parts.append(f"{cardinal(hundredths)} {cent if hundredths == 1 else cents}")
    return " and ".join(parts)


def _percent(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"([-+]?[\d,.]*\d)(?:-([\d,.]*\d))?%", ctx.core[i])
    if match:
        low, high = number(match.group(1)), match.group(2) and number(match.group(2))
        if low and (high or not match.group(2)):
            return [f"{low} to {high} percent" if high else f"{low} percent"]
    if ctx.core[i] == "%":
        return ["percent"]
    return None


def _with_unit(ctx: Context, i: int) -> list[str] | None:
    """ "5kg" -> five kilograms, "72°F", "5 kg", "-3.5 °C", "3x", "100 km/h"."""
    match = re.fullmatch(r"([-+]?\d[\d,]*(?:\.\d+)?)\s?(°[CFK]?|[A-Za-zµ°²/]+2?)", ctx.core[i])
    counted = ctx.at(i - 1).lower() not in ("a", "an")  # "a 512 GB drive": the unit names a kind, singular
    if match and match.group(2) in UNITS:
        amount = counted_amount(match.group(1))
        if amount:
            one, many = UNITS[match.group(2)]
            return [f"{amount[0]} {many if amount[1] and counted else one}"]
    amount = counted_amount(ctx.core[i]) if ctx.at(i + 1) in SPACED_UNITS else None
    if amount and not ctx.trail[i]:
        one, many = UNITS[ctx.at(i + 1)]
        return [amount[0], many if amount[1] and counted else one]
    return None


def _dimensions(ctx: Context, i: int) -> list[str] | None:
    """ "1920x1080" -> nineteen twenty by ten eighty; "3 x 4" -> three by four."""
    match = re.fullmatch(r"(\d+)[x×](\d+)", ctx.core[i])
    if match:
        return [f"{number(match.group(1), years=True)} by {number(match.group(2), years=True)}"]
    if ctx.at(i + 1) in ("x", "×") and number(ctx.core[i]) and number(ctx.at(i + 2)):
        return [number(ctx.core[i]), "by" if ctx.at(i + 1) == "x" else "times"]
    return None


def _ordinal(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"(\d[\d,]*)(st|nd|rd|th)", ctx.core[i], re.I)
    return [ordinal(int(match.group(1).replace(",", "")))] if match else None


def _decade(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"(\d\d)?(\d)0'?s|'(\d)0s", ctx.core[i])
    if not match:
        return None
    tens = int(match.group(2) or match.group(3))
    if match.group(1) and tens == 0:
        century = int(match.group(1))
        return [f"{cardinal(century * 100)}s" if century % 10 == 0 else f"{cardinal(century)} hundreds"]
    plural = {
        "one": "tens",
        "two": "twenties",
        "three": "thirties",
        "four": "forties",
        "five": "fifties",
        "six": "sixties",
        "seven": "seventies",
        "eight": "eighties",
        "nine": "nineties",
    }
    decade = plural[digits(str(tens))]
    if match.group(1):
        prefix = cardinal(int(match.group(1)))
        return [f"{prefix} {decade}"]
    return [decade]


def _fraction(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    vulgar = re.fullmatch(r"(\d*)([½⅓⅔¼¾⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞])", core)
    if vulgar:
        said = fraction(*VULGAR_FRACTIONS[vulgar.group(2)])
        whole = vulgar.group(1)
        return [f"{cardinal(int(whole))} and {said}" if whole else said]
    match = re.fullmatch(r"(\d+)/(\d+)", core)
    if not match:
        return None
    if core == "24/7":
        return ["twenty-four seven"]
    said = fraction(int(match.group(1)), int(match.group(2)))
    if said is None:
        return [f"{cardinal(int(match.group(1)))} slash {cardinal(int(match.group(2)))}"]
    return [said]


def _mixed_number(ctx: Context, i: int) -> list[str] | None:
    """ "3 1/2" -> three and one half."""
    if re.fullmatch(r"\d+", ctx.core[i]) and not ctx.trail[i] and re.fullmatch(r"\d+/\d+", ctx.at(i + 1)):
        n, d = ctx.at(i + 1).split("/")
        if int(n) < int(d) and fraction(int(n), int(d)):
            return [f"{cardinal(int(ctx.core[i]))} and"]
    return None


def _range(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"(\d[\d,.]*)-(\d[\d,.]*)", ctx.core[i])
    if not match:
        return None
    low, high = number(match.group(1), years=True), number(match.group(2), years=True)
    return [f"{low} to {high}"] if low and high else None


def _version(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"(v\.?)?(\d+(?:\.\d+){2,})|v\.?(\d+(?:\.\d+)?)", ctx.core[i], re.I)
    if not match:
        return None
    parts = (match.group(2) or match.group(3)).split(".")
    said = " point ".join(cardinal(int(p)) for p in parts)
    return [f"version {said}" if match.group(1) or match.group(3) else said]


def _roman(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    possessive = core.endswith("'s")
    numeral = core[:-2] if possessive else core
    if not re.fullmatch(r"M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3})", numeral) or not numeral:
        return None
    value = _roman_value(numeral)
    if value > 39 and not re.fullmatch(r"[IVXL]+", numeral):
        return None  # "CD", "DC", "MIX" are words; a regnal or chapter number is small
    before, title = ctx.at(i - 1).rstrip(".,").lower(), ctx.at(i - 2).rstrip(".").lower()
    if before in ROMAN_CARDINAL_AFTER or f"{title} {before}" in ("world war",):
        return [cardinal(value) + ("'s" if possessive else "")]
    name = re.fullmatch(r"[A-Z][a-z]+", ctx.at(i - 1))
    if name and re.fullmatch(r"[IVX]+", numeral) and (len(numeral) > 1 or title in REGNAL_TITLES):
        said = f"the {ordinal(value)}"
        return [said + "'s" if possessive else said]
    return None


def _roman_value(numeral: str) -> int:
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for a, b in zip(numeral, numeral[1:] + " "):
        total += -values[a] if b != " " and values[b] > values[a] else values[a]
    return total


def _abbreviation(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    key = core.rstrip(".").lower()
    after = ctx.at(i + 1)
    if key == "st" and core[:1] == "S":
        before = ctx.at(i - 1)
        street = (before[:1].isupper() or before[:1].isdigit()) and not after[:1].isupper()
        return ["street" if street else "saint"]
    if key in TITLES and (core.endswith(".") or after[:1].isupper()) and core[:1].isupper():
        return [TITLES[key]]
    if key in BEFORE_NUMBER and re.match(r"\d", after) and core.endswith("."):
        return [BEFORE_NUMBER[key]]
    if key in ABBREVIATIONS and (core.endswith(".") or key in ("vs", "etc")):
        return [ABBREVIATIONS[key]]
    return None


def _number_sign(ctx: Context, i: int) -> list[str] | None:
    match = re.fullmatch(r"#(\d+)", ctx.core[i])
    if match:
        return [f"number {cardinal(int(match.group(1)))}"]
    match = re.fullmatch(r"#([A-Za-z]\w*)", ctx.core[i])
    return [f"hashtag {_alnum(match.group(1))}"] if match else None


def _plain_number(ctx: Context, i: int) -> list[str] | None:
    said = number(ctx.core[i], years=True)
    if said is None:
        return None
    if re.fullmatch(r"\d{1,2}", ctx.core[i]) and _AMPM.fullmatch(ctx.at(i + 1)):
        return [said, f"{ctx.at(i + 1)[0].upper()}.M."]
    return [said]


def _plain(core: str) -> str:
    """A word that no rule claimed: letters stay (espeak reads them); symbols and digits inside are spelled."""
    if re.fullmatch(r"[^\W\d_]+(?:['-][^\W\d_]+)*'?", core):
        if core in SPELLED or re.fullmatch(r"[A-Z]{2,5}s?", core) and not re.search(r"[AEIOUY]", core):
            return ".".join(core) + "."
        return core
    if re.fullmatch(r"(?:[A-Za-z]\.){2,}", core):
        return core.upper() if core.lower() not in ("e.g.", "i.e.") else core
    return " ".join(_alnum(part) for part in re.split(r"[-/]", core) if part)


def _alnum(text: str) -> str:
    """Letters, digits and symbols mixed: "COVID19" -> COVID nineteen, "AT&T" -> A.T. and T."""
    words = []
    for run in re.findall(r"\d+(?:\.\d+)?|[^\W\d_]+(?:'[^\W\d_]+)*|[^\w\s]|_", text):
        if run[0].isdigit():
            words.append(number(run) or digits(run))
        elif run in SYMBOL_WORDS:
            words.append(SYMBOL_WORDS[run])
        elif run[0].isalpha():
            words.append(
                ".".join(run) + "." if run in SPELLED or (len(run) <= 3 and run.isupper() and "&" in text) else run
            )
    return " ".join(w for w in words if w)


def _symbol(ctx: Context, i: int) -> list[str] | None:
    core = ctx.core[i]
    if core in SYMBOL_WORDS:
        if core in "$£€¥" and not number(ctx.at(i - 1) or ""):
            return [""]
        return [SYMBOL_WORDS[core]]
    if core.startswith("~") and number(core[1:]):
        return [f"about {number(core[1:])}"]
    if core in ("w/", "w/o"):
        return ["with" if core == "w/" else "without"]
    return None


def _dash_words(ctx: Context, i: int) -> list[str] | None:
    """ "word—word" and "and/or": the parts read apart ("-" alone is a pause, see _markup_free)."""
    core = ctx.core[i]
    if " - " in core:
        return [
            ", ".join(
                _plain(p.strip()) if not number(p.strip()) else number(p.strip())
                for p in core.split(" - ")
                if p.strip()
            )
        ]
    if re.fullmatch(r"[A-Za-z]+/[A-Za-z]+", core):
        return [" ".join(core.split("/"))]
    return None


_RULES = (
    _markup_free,
    _url,
    _phone,
    _date,
    _time,
    _money,
    _percent,
    _number_sign,
    _decade,
    _ordinal,
    _dimensions,
    _with_unit,
    _fraction,
    _mixed_number,
    _version,
    _range,
    _plain_number,
    _roman,
    _abbreviation,
    _symbol,
    _dash_words,
)
