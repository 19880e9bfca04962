//! How the processes around the embed cache see its shared-memory arenas.
//!
//! The cache owns the arenas and their layout; every other process maps them through
//! [`ArenaView`] ([`view`]). A restarted cache has new arenas under a new instance id;
//! requests name the instance whose slots they were granted, and [`ArenaMap`] ([`remap`])
//! maps a newer instance's arenas once, however many requests ask at the same time. The
//! api, the encoder and the engine all use it. [`ByteSize`] ([`size`]) is how sizes are
//! written on the command line.

pub mod remap;
pub mod size;
pub mod view;

pub use remap::{ArenaError, ArenaMap, Mapped};
pub use size::ByteSize;
pub use view::{ArenaView, EmbedRows};
