//! iop-edge

fn main() {}
