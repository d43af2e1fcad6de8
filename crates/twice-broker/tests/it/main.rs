//! Integration tests of twice-broker: durability across restarts, corruption, crashes under
//! load, memory with a large backlog, long polls, and the in-process transport.

mod corruption;
mod crash;
mod durability;
mod memory;
mod receive;
mod support;
mod transport;
