//! The engine task, watched. The router cannot serve without it, so its end is never silent: whoever
//! holds the `EngineTask` learns why it ended (a panic's message, or an end while handles remain), and the
//! binary logs it and exits non-zero so that its supervisor restarts it. Meanwhile `/health` and `/ready`
//! fail (`EngineHandle::is_running`).

use tokio::task::JoinHandle;

use super::EngineCore;

/// The running engine task.
pub struct EngineTask {
    task: JoinHandle<()>,
}

/// Starts the engine loop on its own task.
pub fn spawn(core: EngineCore) -> EngineTask {
    EngineTask {
        task: tokio::spawn(core.run()),
    }
}

impl EngineTask {
    /// Waits for the engine task to end and says why it did. While handles to it remain it only ends by
    /// panicking (or being aborted), and every request after that would fail.
    pub async fn stopped(self) -> String {
        match self.task.await {
            Ok(()) => "the engine loop returned".into(),
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".into());
                format!("the engine panicked: {message}")
            }
            Err(_) => "the engine task was cancelled".into(),
        }
    }

    /// Resolves when `drained` does (the server's graceful shutdown), with `Ok`; if the engine task ends
    /// first, every request would fail from then on, so it resolves at once with why, as `Err`, for the
    /// binary to log and exit non-zero.
    pub async fn until_drained(self, drained: impl std::future::Future<Output = ()>) -> Result<(), String> {
        tokio::select! {
            () = drained => Ok(()),
            reason = self.stopped() => Err(reason),
        }
    }

    /// Stops the engine task: an engine that died, for tests.
    #[cfg(test)]
    pub fn abort(&self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_reported_with_its_message() {
        let task = EngineTask {
            task: tokio::spawn(async {
                let id = 7;
                panic!("the plan names sequence {id}, which is not running");
            }),
        };
        let reason = task.stopped().await;
        assert_eq!(
            reason,
            "the engine panicked: the plan names sequence 7, which is not running"
        );
    }

    #[tokio::test]
    async fn a_panicking_engine_ends_serving_that_never_drains() {
        let task = EngineTask {
            task: tokio::spawn(async { panic!("a shard answered a sequence it was not asked for") }),
        };
        let never_drained = std::future::pending::<()>();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), task.until_drained(never_drained))
            .await
            .expect("the engine's panic must end serving, not wait for a drain");
        assert_eq!(
            ended,
            Err("the engine panicked: a shard answered a sequence it was not asked for".into())
        );
    }

    #[tokio::test]
    async fn a_drain_ends_serving_while_the_engine_runs() {
        let task = EngineTask {
            task: tokio::spawn(std::future::pending::<()>()),
        };
        assert_eq!(task.until_drained(async {}).await, Ok(()));
    }

    #[tokio::test]
    async fn an_end_is_reported() {
        let task = EngineTask {
            task: tokio::spawn(async {}),
        };
        assert_eq!(task.stopped().await, "the engine loop returned");
    }
}
