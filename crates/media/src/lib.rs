//! Media (being written).
