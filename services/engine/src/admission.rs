//! Admission by token budget (being written).
