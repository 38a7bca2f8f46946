//! iop-transport (being written)

pub mod clock;
pub mod logging;
pub mod settings;
pub mod signals;
