"""The facts the normaliser reads English by: abbreviations, units, symbols, months, letters.

One table per fact; `tts.normalize` holds the rules that use them. Keys of the abbreviation tables are
lower-case and without their period.
"""
from __future__ import annotations

# Titles that stand before a name: never the end of a sentence ("Dr. Smith"). "St." after a name is street.
TITLES = {
    "mr": "mister", "mrs": "missus", "ms": "miz", "dr": "doctor", "prof": "professor", "gen": "general",
    "col": "colonel", "capt": "captain", "lt": "lieutenant", "sgt": "sergeant", "gov": "governor",
    "sen": "senator", "rep": "representative", "rev": "reverend", "hon": "honorable", "pres": "president",
    "mt": "mount", "ft": "fort", "fr": "father", "messrs": "messieurs", "st": "saint",
}
# Read with their period; ``NONFINAL`` ones never end a sentence ("e.g. Paris").
ABBREVIATIONS = {
    "jr": "junior", "sr": "senior", "ave": "avenue", "blvd": "boulevard", "rd": "road", "ln": "lane",
    "dept": "department", "univ": "university", "inc": "incorporated", "ltd": "limited",
    "corp": "corporation", "co": "company", "bros": "brothers", "vs": "versus", "etc": "et cetera",
    "e.g": "for example", "i.e": "that is", "approx": "approximately", "misc": "miscellaneous",
    "cf": "compare", "est": "established", "min": "minutes", "max": "maximum", "avg": "average",
    "mon": "Monday", "tue": "Tuesday", "tues": "Tuesday", "wed": "Wednesday", "thu": "Thursday",
    "thurs": "Thursday", "fri": "Friday", "sat": "Saturday", "sun": "Sunday", "ph.d": "P.H.D.",
}
NONFINAL = {"e.g", "i.e", "vs", "cf", "approx", "no", "nos", "p", "pp", "vol", "ch", "fig", "sec", "art"}
# Read this way only before a number: "No. 5", "p. 12", "Jan. 4" (else "no", "Jan" stay words).
BEFORE_NUMBER = {
    "no": "number", "nos": "numbers", "p": "page", "pp": "pages", "vol": "volume", "ch": "chapter",
    "fig": "figure", "sec": "section", "art": "article", "jan": "January", "feb": "February",
    "mar": "March", "apr": "April", "jun": "June", "jul": "July", "aug": "August", "sep": "September",
    "sept": "September", "oct": "October", "nov": "November", "dec": "December",
}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
MONTH_OF = {m.lower(): i + 1 for i, m in enumerate(MONTHS)} | {
    k: MONTHS.index(v) + 1 for k, v in BEFORE_NUMBER.items() if v in MONTHS}

# Currency: symbol or code -> (one, many, one hundredth, hundredths).
CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
    "€": ("euro", "euros", "cent", "cents"), "¥": ("yen", "yen", "sen", "sen"),
    "₹": ("rupee", "rupees", "paisa", "paise"), "₩": ("won", "won", "jeon", "jeon"),
}
CURRENCY_CODES = {"usd": "$", "eur": "€", "gbp": "£", "jpy": "¥", "inr": "₹"}
MAGNITUDES = {"k": "thousand", "m": "million", "mn": "million", "mm": "million", "b": "billion",
              "bn": "billion", "t": "trillion", "tn": "trillion", "thousand": "thousand", "million": "million",
              "billion": "billion", "trillion": "trillion"}

# Units after a number: symbol -> (singular, plural). Case matters ("m" metre, "M" mega-anything).
UNITS = {
    "mm": ("millimeter", "millimeters"), "cm": ("centimeter", "centimeters"), "m": ("meter", "meters"),
    "km": ("kilometer", "kilometers"), "µm": ("micrometer", "micrometers"), "nm": ("nanometer", "nanometers"),
    "mg": ("milligram", "milligrams"), "g": ("gram", "grams"), "kg": ("kilogram", "kilograms"),
    "t": ("tonne", "tonnes"), "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"),
    "l": ("liter", "liters"), "L": ("liter", "liters"), "cl": ("centiliter", "centiliters"),
    "in": ("inch", "inches"), "ft": ("foot", "feet"), "yd": ("yard", "yards"), "mi": ("mile", "miles"),
    "oz": ("ounce", "ounces"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "gal": ("gallon", "gallons"), "tbsp": ("tablespoon", "tablespoons"), "tsp": ("teaspoon", "teaspoons"), "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
    "m/s": ("meter per second", "meters per second"), "ms": ("millisecond", "milliseconds"),
    "s": ("second", "seconds"), "sec": ("second", "seconds"), "min": ("minute", "minutes"),
    "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour", "hours"),
    "Hz": ("hertz", "hertz"), "kHz": ("kilohertz", "kilohertz"), "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"), "W": ("watt", "watts"), "kW": ("kilowatt", "kilowatts"),
    "MW": ("megawatt", "megawatts"), "kWh": ("kilowatt hour", "kilowatt hours"), "V": ("volt", "volts"),
    "mA": ("milliamp", "milliamps"), "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"),
    "MB": ("megabyte", "megabytes"), "GB": ("gigabyte", "gigabytes"), "TB": ("terabyte", "terabytes"),
    "Mbps": ("megabit per second", "megabits per second"), "Gbps": ("gigabit per second", "gigabits per second"),
    "°": ("degree", "degrees"), "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"), "°K": ("kelvin", "kelvins"),
    "x": ("times", "times"), "×": ("times", "times"), "px": ("pixel", "pixels"), "pt": ("point", "points"),
    "sq ft": ("square foot", "square feet"), "m²": ("square meter", "square meters"),
    "km²": ("square kilometer", "square kilometers"), "m2": ("square meter", "square meters"),
}
# A unit written apart from its number ("5 kg") only where it cannot be a word: not "in", "s", "t", "x".
SPACED_UNITS = set(UNITS) - {"in", "s", "t", "x", "h", "l", "pt"}

# Symbols read aloud where they stand alone or between words.
SYMBOL_WORDS = {
    "&": "and", "+": "plus", "=": "equals", "@": "at", "%": "percent", "°": "degrees", "×": "times",
    "÷": "divided by", "±": "plus or minus", "<": "less than", ">": "greater than", "≤": "at most",
    "≥": "at least", "≈": "approximately", "~": "about", "§": "section", "©": "copyright",
    "®": "registered", "™": "trademark", "#": "number", "→": "to", "->": "to", "/": "slash", "\\": "backslash",
    "$": "dollars", "£": "pounds", "€": "euros", "¥": "yen",
}
# Separators inside URLs and e-mail addresses.
URL_SYMBOLS = {".": "dot", "/": "slash", "@": "at", ":": "colon", "-": "dash", "_": "underscore",
               "?": "question mark", "=": "equals", "&": "and", "#": "hash", "~": "tilde", "+": "plus",
               "%": "percent"}
TOP_DOMAINS = {"com", "org", "net", "io", "ai", "dev", "edu", "gov", "co", "uk", "de", "fr", "app", "info",
               "biz", "us", "ca", "me", "tv", "ly", "gg", "xyz", "ru", "jp", "cn", "au", "nl", "eu", "es", "it"}

# Letter names, as <say-as interpret-as="characters"> spells a word (`tts.ssml`)
LETTER_NAMES = dict(zip("abcdefghijklmnopqrstuvwxyz", (
    "ay bee see dee ee eff gee aitch eye jay kay el em en oh pee cue ar ess tee you vee double-you ex why zee").split()))

# Acronyms spelled letter by letter that espeak would read as words (it spells FBI, CEO, USA, API itself).
SPELLED = {"NYC", "IO", "IOU", "UAE", "AWS", "ETA", "UPS", "EV", "PS", "ICU", "IPA", "AT"}

# Roman numerals are numbers after these words ("Chapter IV" -> chapter four) ...
ROMAN_CARDINAL_AFTER = {"chapter", "part", "volume", "vol", "book", "act", "scene", "section", "war", "phase",
                        "stage", "level", "round", "episode", "appendix", "article", "title", "series", "season",
                        "psalm", "canto", "plate", "figure", "fig", "table", "grade", "class", "type", "unit",
                        "rocky", "apollo"}
# ... and ordinals after a name ("Henry VIII" -> Henry the eighth); I, V and X only after a regnal title.
REGNAL_TITLES = {"king", "queen", "pope", "emperor", "empress", "tsar", "czar", "prince", "princess", "duke",
                 "sultan", "pharaoh", "kaiser", "saint"}


FRACTION_NAMES = {2: ("half", "halves"), 4: ("quarter", "quarters")}
VULGAR_FRACTIONS = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5),
                    "⅗": (3, 5), "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8),
                    "⅞": (7, 8)}
