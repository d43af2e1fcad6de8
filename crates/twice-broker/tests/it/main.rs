//! Integration tests of twice-broker: durability across restarts, corruption, crashes under
//! load, memory with a large backlog, long polls, subscription rules and session listing, and
//! the in-process transport, and a tidy check that the engine stays pure.

mod amplification;
mod corruption;
mod crash;
mod descriptors;
mod durability;
mod limits;
mod management;
mod memory;
mod quota;
mod receive;
mod security;
mod support;
mod tidy;
mod transport;
