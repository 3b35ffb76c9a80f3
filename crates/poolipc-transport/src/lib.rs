//! poolipc's wire protocol over Unix sockets.
