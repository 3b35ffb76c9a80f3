//! What a job's view shows: the facade's view of an input or a result, as the worker thread
//! cloned it out of the job. Below the thread that takes jobs and the views that show them.

/// What a [`View`](super::View) shows: the facade's view of a job's input or result, as the
/// worker thread cloned it out of the job (the same value, not a description of it).
#[derive(Clone)]
pub(super) enum Shown {
    /// An input view.
    Input(poolipc::InputView),
    /// A result buffer the parent granted (contiguous, writable).
    Result(poolipc::ResultView),
}

impl Shown {
    /// The input views of a job the thread took.
    pub(super) fn inputs_of(job: &poolipc::Job<'_>) -> Vec<Shown> {
        job.inputs().iter().cloned().map(Shown::Input).collect()
    }
}
