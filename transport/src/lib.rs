//! iop-transport (being written)
