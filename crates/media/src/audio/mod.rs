//! Audio: decoding, resampling and Whisper log-mel features (being written).
