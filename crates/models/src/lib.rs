//! Model code (being written).
