//! Tests of the contract as a whole: the property tests against the reference model and the
//! mutations they must catch, plus scenario tests of single behaviours.

mod mutations;
mod property;
mod scenarios;
