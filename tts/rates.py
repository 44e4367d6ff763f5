"""The audio's sample rate, defined once (the codec's `CodecConfig.sample_rate` defaults to it; a codec frame is
`CodecConfig.hop` samples, so its frame rate is `CodecConfig.frame_rate`)."""

SAMPLE_RATE = 24_000
