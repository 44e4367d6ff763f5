"""The modern held-out set: well-formed, its licences recorded, never in training text; its teacher cache and the
decoder comparison on it."""

import re

import numpy as np
import pytest
import soundfile as sf

from bench import modern
from training.corpus import MODERN_DIR, make_utterances
from tts.text import normalize

ALL = modern.sentences("test") + modern.sentences("dev")


def test_the_reported_split_has_200_sentences_and_the_dev_split_about_40_none_shared():
    test, dev = modern.sentences("test"), modern.sentences("dev")
    assert len(test) >= 200 and 30 <= len(dev) <= 60
    assert len({s.id for s in ALL}) == len(ALL)
    assert not {s.text for s in test} & {s.text for s in dev}
    for split in (test, dev):
        assert {s.category for s in split} == set(modern.CATEGORIES)


def test_every_sentence_is_plain_speakable_text_of_4_to_30_words_with_a_recorded_source():
    readme = (MODERN_DIR / "README.md").read_text()
    for s in ALL:
        assert 4 <= len(s.text.split()) <= 30, s
        assert not re.search(r"https?:|www\.|@|<|>|\t|\*|#", s.text), s
        assert s.id.startswith(s.category + "-"), s
        assert s.source == "ours" or s.source.startswith("spamassassin:easy-ham-"), s
    assert "`spamassassin:GROUP/NNNNN`" in readme and "`ours`" in readme and "CC0-1.0" in readme


def test_no_modern_sentence_reaches_training_text():
    """Each sentence as a paragraph of its own between two training-like ones: the training-like ones stay,
    the modern one never appears in an utterance, as typed or as normalised."""
    filler = "The ship sailed on through the night. The crew sang by the fire."
    paragraphs = [f"{filler} {s.text} {filler}" for s in ALL]
    text = " | ".join(make_utterances(paragraphs))
    assert "The ship sailed on through the night." in text
    for s in ALL:
        assert s.text not in text and normalize(s.text) not in text, s


def test_an_unknown_split_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown split"):
        modern.sentences("train")


def test_cached_teacher_audio_is_read_back_and_never_spoken_again(tmp_path):
    """A voice with no teacher raises unless its clip is cached: the cache is read, not re-spoken."""
    sentence = modern.sentences("dev")[0]
    with pytest.raises(ValueError, match="no teacher"):
        modern.teacher_audio("nobody", sentence, tmp_path)
    clip = (0.1 * np.sin(np.arange(24_000) / 10)).astype(np.float32)
    path = modern.teacher_path("nobody", sentence, tmp_path)
    path.parent.mkdir(parents=True)
    sf.write(path, clip, 24_000, format="FLAC", subtype="PCM_24")
    assert np.allclose(modern.teacher_audio("nobody", sentence, tmp_path), clip, atol=1e-6)


def test_a_decoder_that_gives_back_the_teacher_scores_exactly_the_teacher(tmp_path):
    """The comparison's arithmetic: a perfect decoder's gaps are 0; the shipped codec's round trip is scored
    per sentence; teacher scores are cached beside the audio."""
    pytest.importorskip("speechmos")
    from tts.codec import load_codec
    from tts.voices import VOICES_DIR

    speech, sr = sf.read(MODERN_DIR.parents[2] / "tests" / "data" / "heldout_joe.wav", dtype="float32")
    assert sr == 24_000
    sentence = modern.sentences("dev")[0]
    path = modern.teacher_path("joe", sentence, tmp_path)
    path.parent.mkdir(parents=True)
    sf.write(path, speech, 24_000, format="FLAC", subtype="PCM_24")
    teacher = modern.teacher_audio("joe", sentence, tmp_path)
    codec = load_codec(VOICES_DIR)
    perfect = modern.compare_decoder(lambda codes: teacher, ("joe",), "dev", 1, codec.encode, tmp_path)
    joe = perfect["voices"]["joe"]
    assert perfect["sentences"] == 1 and joe["gap_ovrl"] == joe["gap_sig"] == joe["gap_wer"] == 0
    assert joe["rows"][0]["roundtrip"]["mel_l1"] == pytest.approx(0, abs=1e-6)
    assert path.with_suffix(".json").exists()
    shipped = modern.compare_decoder(codec.decode, ("joe",), "dev", 1, codec.encode, tmp_path)["voices"]["joe"]
    row = shipped["rows"][0]
    assert row["id"] == sentence.id and row["teacher"] == joe["rows"][0]["teacher"]
    assert 1 < row["roundtrip"]["ovrl"] < 5 and 0 < row["roundtrip"]["mel_l1"] < 2
