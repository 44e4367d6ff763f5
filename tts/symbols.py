"""The unit inventory: the phonemiser's symbols and their ids (the text encoder's vocabulary)."""

from __future__ import annotations

# Index 0 is padding. The order is frozen: model checkpoints index into it.
SYMBOLS = (
    "_^$ !'(),-.:;?abcdefhijklmnopqrstuvwxyzæçðøħŋœǀǁǂǃɐɑɒɓɔɕɖɗɘəɚɛɜɞɟɠɡɢɣɤɥɦɧɨɪɫɬɭɮɯɰɱɲɳɴɵɶɸ"
    "ɹɺɻɽɾʀʁʂʃʄʈʉʊʋʌʍʎʏʐʑʒʔʕʘʙʛʜʝʟʡʢʲˈˌːˑ˞βθχᵻⱱ0123456789̧̪̯̩̃ʰˤε↓#"
)
SYMBOL_ID = {s: i for i, s in enumerate(SYMBOLS)}
