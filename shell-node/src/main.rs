//! iop-node

fn main() {}
