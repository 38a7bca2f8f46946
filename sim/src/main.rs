//! iop-sim

fn main() {}
