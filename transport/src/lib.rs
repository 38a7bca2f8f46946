//! iop-transport (being written)

pub mod clock;
pub mod settings;
