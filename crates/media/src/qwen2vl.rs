//! Qwen2-VL image processor (being written).
