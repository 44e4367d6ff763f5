"""Text normalisation: what a reader says for real English text (issue 24's table), sentence splitting,
markup, and bad input that can only ever raise TextError."""

import random

import pytest

from tts.normalize import TextError, normalize, split_sentences, tokenize
from tts.text import text_sentences, text_to_sentences

CASES = [
    # issue 24's "Why": every one of these was read wrongly
    ("2024-03-04", "March fourth, twenty twenty-four"),
    ("3:45pm", "three forty-five P.M."),
    ("1/2 cup", "one half cup"),
    ("555-123-4567", "five five five, one two three, four five six seven"),
    ("5kg", "five kilograms"),
    ("3x", "three times"),
    ("72°F", "seventy-two degrees Fahrenheit"),
    ("-3", "minus three"),
    ("1990s", "nineteen nineties"),
    ("2.0.1", "two point zero point one"),
    ("St. Mark St.", "saint Mark street."),
    ("https://example.com/docs", "example dot com slash docs"),
    ("e.g. apples", "for example apples"),
    ("the U.S. army", "the U.S. army"),
    ("Chapter IV", "Chapter four"),
    # dates
    ("On 3/4/2021 we met", "On March fourth, twenty twenty-one we met"),
    ("12/25/1999", "December twenty-fifth, nineteen ninety-nine"),
    ("1/1/2000", "January first, two thousand"),
    ("7/4/76", "July fourth, nineteen seventy-six"),
    ("03-15-2023", "March fifteenth, twenty twenty-three"),
    ("2000-01-01", "January first, two thousand"),
    ("1999-12-31", "December thirty-first, nineteen ninety-nine"),
    ("March 4, 2024", "March fourth, twenty twenty-four"),
    ("on May 5th", "on May fifth"),
    ("Jan. 4 was cold", "January fourth was cold"),
    ("Sept. 11", "September eleventh"),
    ("4 July 1776", "the fourth of July seventeen seventy-six"),
    ("the 21st of June", "the twenty-first of June"),
    ("in December 1941", "in December nineteen forty-one"),
    ("May I come in", "May I come in"),
    ("I march 5 miles", "I march five miles"),
    # times
    ("10:30", "ten thirty"),
    ("at 9:05 am", "at nine oh five A.M."),
    ("7:00", "seven o'clock"),
    ("14:00", "fourteen hundred"),
    ("23:45", "twenty-three forty-five"),
    ("10am", "ten A.M."),
    ("10 am sharp", "ten A.M. sharp"),
    ("6 p.m. today", "six P.M. today"),
    ("3:45 PM", "three forty-five P.M."),
    ("12:30:15", "twelve thirty and fifteen seconds"),
    ("11 PM", "eleven P.M."),
    ("3.45pm", "three forty-five P.M."),
    ("at 3.45 p.m.", "at three forty-five P.M."),
    # years and decades
    ("In 1851", "In eighteen fifty-one"),
    ("in 2005", "in two thousand five"),
    ("in 2010", "in twenty ten"),
    ("in 1905", "in nineteen oh-five"),
    ("in 1066", "in ten sixty-six"),
    ("the 80s", "the eighties"),
    ("the '60s", "the sixties"),
    ("the 1900s", "the nineteen hundreds"),
    ("the 2000s", "the two thousands"),
    ("the 2010s", "the twenty tens"),
    ("from 1990 to 1995", "from nineteen ninety to nineteen ninety-five"),
    ("1939-1945", "nineteen thirty-nine to nineteen forty-five"),
    # ordinals
    ("1st", "first"),
    ("the 2nd ship", "the second ship"),
    ("3rd place", "third place"),
    ("22nd", "twenty-second"),
    ("103rd", "one hundred third"),
    ("the 11th hour", "the eleventh hour"),
    ("1,000th", "one thousandth"),
    # cardinals with separators
    ("1,200", "one thousand two hundred"),
    ("1,234,567", "one million two hundred thirty-four thousand five hundred sixty-seven"),
    ("42", "forty-two"),
    ("0", "zero"),
    ("100", "one hundred"),
    ("105 cats", "one hundred five cats"),
    (
        "9,999,999,999",
        "nine billion nine hundred ninety-nine million nine hundred ninety-nine thousand nine hundred ninety-nine",
    ),
    ("007", "zero zero seven"),
    ("3000 people", "three thousand people"),
    ("1500 miles", "fifteen hundred miles"),
    # decimals and negatives
    ("3.14", "three point one four"),
    ("0.5", "zero point five"),
    (".5", "point five"),
    ("-2.5", "minus two point five"),
    ("-40 degrees", "minus forty degrees"),
    ("+5", "plus five"),
    ("1,234.56", "one thousand two hundred thirty-four point five six"),
    ("a -3 score", "a minus three score"),
    # fractions
    ("3/4", "three quarters"),
    ("2/3 of it", "two thirds of it"),
    ("1/3", "one third"),
    ("5/8 inch", "five eighths inch"),
    ("1/10", "one tenth"),
    ("3 1/2 cups", "three and one half cups"),
    ("½", "one half"),
    ("2½ hours", "two and one half hours"),
    ("¾", "three quarters"),
    ("24/7", "twenty-four seven"),
    # percentages
    ("45.5% of 1,200", "forty-five point five percent of one thousand two hundred"),
    ("100%", "one hundred percent"),
    ("10-20%", "ten to twenty percent"),
    ("0.1%", "zero point one percent"),
    ("50 %", "fifty percent"),
    # currencies
    ("$3.50", "three dollars and fifty cents"),
    ("$1", "one dollar"),
    ("$0.99", "ninety-nine cents"),
    ("$5M", "five million dollars"),
    ("$2.5B", "two point five billion dollars"),
    ("$3k", "three thousand dollars"),
    ("$1.2bn", "one point two billion dollars"),
    ("$5 million", "five million dollars"),
    ("$10 billion deal", "ten billion dollars deal"),
    ("$5-$10", "five to ten dollars"),
    ("$5-10", "five to ten dollars"),
    ("£1", "one pound"),
    ("£20.50", "twenty pounds and fifty pence"),
    ("€20", "twenty euros"),
    ("€1.01", "one euro and one cent"),
    ("¥1000", "one thousand yen"),
    ("100 USD", "one hundred dollars"),
    ("$1,000,000", "one million dollars"),
    ("It costs $12.", "It costs twelve dollars."),
    # phone numbers
    ("(555) 123-4567", "five five five, one two three, four five six seven"),
    ("1-800-555-0199", "one, eight oh oh, five five five, oh one nine nine"),
    ("555.123.4567", "five five five, one two three, four five six seven"),
    ("+1-555-123-4567", "one, five five five, one two three, four five six seven"),
    # units, with and without a space
    ("5 kg", "five kilograms"),
    ("1 kg", "one kilogram"),
    ("1.5kg", "one point five kilograms"),
    ("10km", "ten kilometers"),
    ("100 km/h", "one hundred kilometers per hour"),
    ("60 mph", "sixty miles per hour"),
    ("3.5 m", "three point five meters"),
    ("5 ft", "five feet"),
    ("1 ft", "one foot"),
    ("12 oz", "twelve ounces"),
    ("2 lbs", "two pounds"),
    ("500 ml", "five hundred milliliters"),
    ("2L", "two liters"),
    ("5 cm", "five centimeters"),
    ("3mm", "three millimeters"),
    ("250 mg", "two hundred fifty milligrams"),
    ("20°C", "twenty degrees Celsius"),
    ("-3.5 °C", "minus three point five degrees Celsius"),
    ("98.6°F", "ninety-eight point six degrees Fahrenheit"),
    ("90°", "ninety degrees"),
    ("5 GB", "five gigabytes"),
    ("100MB", "one hundred megabytes"),
    ("3 GHz", "three gigahertz"),
    ("60 Hz", "sixty hertz"),
    ("100 W", "one hundred watts"),
    ("220V", "two hundred twenty volts"),
    ("30 min", "thirty minutes"),
    ("5 hrs", "five hours"),
    ("200 ms", "two hundred milliseconds"),
    ("10s of people", "tens of people"),
    ("1920x1080", "nineteen twenty by ten eighty"),
    ("3 x 4", "three by four"),
    ("4K video", "four K video"),
    ("a 512 GB drive", "a five hundred twelve gigabyte drive"),
    ("2 tbsp of butter", "two tablespoons of butter"),
    # versions
    ("v1.2", "version one point two"),
    ("v2", "version two"),
    ("version 3.11.4", "version three point eleven point four"),
    ("Python 3.11", "Python three point one one"),
    # Roman numerals in context
    ("Chapter IX", "Chapter nine"),
    ("Part II", "Part two"),
    ("World War II", "World War two"),
    ("Henry VIII", "Henry the eighth"),
    ("Louis XIV's court", "Louis the fourteenth's court"),
    ("King George V", "King George the fifth"),
    ("Queen Elizabeth II", "Queen Elizabeth the second"),
    ("Volume III", "Volume three"),
    ("Then I left", "Then I left"),
    ("Malcolm X", "Malcolm X"),
    ("Washington DC", "Washington D.C."),
    ("a CD player", "a C.D. player"),
    # URLs and e-mail
    ("www.google.com", "W.W.W. dot google dot com"),
    ("john.doe@gmail.com", "john dot doe at gmail dot com"),
    ("example.org", "example dot org"),
    ("http://foo.io/a/b", "foo dot io slash a slash b"),
    ("docs.python.org/3/", "docs dot python dot org slash three"),
    ("support@acme.co.uk", "support at acme dot co dot uk"),
    # abbreviations and acronyms
    ("Dr. Smith paid $3.50.", "doctor Smith paid three dollars and fifty cents."),
    ("Mr. & Mrs. Brown", "mister and missus Brown"),
    ("Prof. Lee", "professor Lee"),
    ("Mt. Everest", "mount Everest"),
    ("St. Louis", "saint Louis"),
    ("Main St.", "Main street."),
    ("No. 5", "number five"),
    ("I said no.", "I said no."),
    ("apples, pears, etc.", "apples, pears, et cetera."),
    ("cats vs. dogs", "cats versus dogs"),
    ("i.e. never", "that is never"),
    ("Acme Inc.", "Acme incorporated."),
    ("Martin Luther King Jr.", "Martin Luther King junior."),
    ("approx. 5", "approximately five"),
    ("p. 12", "page twelve"),
    ("the FBI", "the FBI"),
    ("NASA", "NASA"),
    ("NYC", "N.Y.C."),
    ("HTML", "H.T.M.L."),
    ("AT&T", "A.T. and T."),
    ("COVID-19", "COVID nineteen"),
    ("J. R. R. Tolkien", "J R R Tolkien"),
    ("Ph.D.", "P.H.D."),
    ("a Ph.D. in math", "a P.H.D. in math"),
    # symbols
    ("Tom & Jerry", "Tom and Jerry"),
    ("2 + 2 = 4", "two plus two equals four"),
    ("#1", "number one"),
    ("#hashtag", "hashtag hashtag"),
    ("a @ b", "a at b"),
    ("~5 minutes", "about five minutes"),
    ("© 2024", "copyright twenty twenty-four"),
    ("w/ cheese", "with cheese"),
    ("and/or", "and or"),
    ("wait—what", "wait, what"),
    ("yes - no", "yes, no"),
    ("Wait... what?", "Wait, what?"),
    ("“quoted”", "quoted"),
    ("(in brackets)", "in brackets"),
    ("THIS IS VERY LOUD TEXT", "this is very loud text"),
    ("café au lait", "café au lait"),
    ("don't", "don't"),
    ("state-of-the-art", "state-of-the-art"),
    # too long, control characters
    ("1" * 40, " ".join(["one"] * 40)),
    ("a\x00b\x07c", "abc"),
    ("tab\there", "tab here"),
]


@pytest.mark.parametrize("raw, spoken", CASES)
def test_normalize(raw, spoken):
    assert normalize(raw) == spoken


def test_table_is_large_enough():
    assert len(CASES) >= 150


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("Dr. Li came. He sat.", ["Dr. Li came.", "He sat."]),
        ("See e.g. Paris. It is big.", ["See e.g. Paris.", "It is big."]),
        ("J. R. R. Tolkien wrote it.", ["J. R. R. Tolkien wrote it."]),
        ("It costs 3.5 dollars. Fine.", ["It costs 3.5 dollars.", "Fine."]),
        ("Go to example.com. Then stop.", ["Go to example.com.", "Then stop."]),
        ("Wait; then: go.", ["Wait; then: go."]),
        ("At 3 p.m. today we eat.", ["At 3 p.m. today we eat."]),
        ("No. 5 won! Really? Yes.", ["No. 5 won!", "Really?", "Yes."]),
        ("'Hi!' he said.", ["'Hi!' he said."]),
        ("Title\n\nBody text here", ["Title", "Body text here"]),
        ("St. Mark St. is here. Go.", ["St. Mark St. is here.", "Go."]),
    ],
)
def test_sentences(text, sentences):
    tokens = tokenize(text)
    spans = split_sentences(tokens, final=True)
    assert [" ".join(t.text for t in tokens[a:b]) for a, b, _ in spans] == [s.replace("\n\n", " ") for s in sentences]


def test_sentence_end_waits_for_the_next_word():
    tokens = tokenize("He met Dr.")
    assert split_sentences(tokens, final=False) == [(0, 3, False)]
    assert split_sentences(tokens, final=True) == [(0, 3, True)]


def test_markup_pause_and_phonemes():
    ((tokens, units, owners),) = text_sentences(
        'Say <break time="1s"/> [[h ə l ˈoʊ]] to <phoneme ph="təmˈɑːtoʊ">tomato</phoneme>.'
    )
    kinds = [t.kind for t in tokens]
    assert kinds == ["word", "pause", "phonemes", "word", "phonemes", "word"]
    spelled = "".join(units)
    assert "həlˈoʊ" in spelled and "təmˈɑːtoʊ." in spelled and spelled.endswith("$")
    assert [u for u, o in zip(units, owners) if o == 4] == list("təmˈɑːtoʊ")
    assert tokens[1].pause_ms == 1000 and tokens[4].word == "tomato"


@pytest.mark.parametrize("bad", ["[[HELLO]]", '<phoneme ph="Q">x</phoneme>', "[[ ]]"])
def test_bad_phonemes_are_text_errors(bad):
    with pytest.raises(TextError):
        text_to_sentences(bad)


def test_only_text_error_ever(tmp_path):
    """Random text of digits, symbols, letters, markup pieces and control characters: spoken, or TextError."""
    rng = random.Random(0)
    alphabet = list("0123456789$£€%.,:;/-+x°#@&()[]<>\"' \n\t\x00\x7f½ⅨАé日") + [
        "kg",
        "am",
        "Dr.",
        "St.",
        "[[",
        "]]",
        "<break/>",
        "http://",
        "1e400",
        "IV",
    ]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        try:
            text_to_sentences(text)
        except TextError:
            pass


def test_huge_number_is_read_digit_by_digit():
    units = text_to_sentences("7" * 400)
    assert sum(len(s) for s in units) > 400 * 4  # "seven" 400 times, no OverflowError


def test_plain_words_read_as_the_rules_read_them():
    """The plain-word shortcut (`plain_word`) gives what the rules give, for every token of the table, the
    Harvard sentences, the fuzz alphabet and every word the tables name (capitalised too)."""
    from bench.common import HARVARD
    from tts import normalize_tables as tables
    from tts.normalize_rules import Context, by_rules, first_rule, plain_word

    texts = [raw for raw, _ in CASES] + (HARVARD.read_text().splitlines() if HARVARD.exists() else [])
    named = {
        w
        for table in (
            tables.MONTH_OF,
            tables.TITLES,
            tables.ABBREVIATIONS,
            tables.BEFORE_NUMBER,
            tables.SYMBOL_WORDS,
            tables.UNITS,
            tables.ROMAN_CARDINAL_AFTER,
            tables.REGNAL_TITLES,
            tables.CURRENCY_CODES,
            tables.MAGNITUDES,
        )
        for w in table
    }
    texts += [f"{w} {w.capitalize()} {w.upper()} 5 {w} {w}. {w.capitalize()} 4 {w}'s" for w in sorted(named)]
    texts += ["I V X IV MIX CD Dr Mr St vs etc ½ ² café naïve co-op rock'n'roll O'Neil '90s", "Henry VIII I saw"]
    function_words = (
        "the a an to of in on at for and or nor as by from with into onto upon than that is was be are "
        "were it its his her their my your our this these those he she we they i you not no but so if "
        "over under"
    ).split()
    texts += [f"{w} {w.capitalize()} {w.upper()} 5 {w} {w}. {w.capitalize()} 4 {w}'s" for w in function_words]
    plain = 0
    for text in texts:
        for start, stop, _ in split_sentences(tokenize(text), final=True):
            ctx = Context(tokenize(text)[start:stop])
            for i, token in enumerate(ctx.tokens):
                if token.kind == "word":
                    assert first_rule(ctx, i) == by_rules(ctx, i), (text, token.text)
                    plain += plain_word(ctx.core[i])
    assert plain > 1000  # the shortcut was taken
    assert not any(plain_word(w) for w in ["March", "IV", "I", "vs", "½", "5kg", "Dr", "st", "U.S.", ""])
