//! The command line's modules (the `burn-nanovllm` binary's, not the library's): the options
//! the commands share and the commands themselves.

pub(crate) mod commands;
pub(crate) mod options;
