//! Shared reads of episodic memory. Diagnose, plan and evaluate each read the memory of their
//! run's service and error signature; when many runs of one error are in flight (an incident
//! storm, a load test), those reads ask the same question many times a second. A read that
//! arrives while another read of the same key is still waiting for a connection joins it and
//! takes its answer: one statement for the lot.
//!
//! Joining never returns an answer older than the call: the query is sent only once the
//! leading read has its connection, and it stops taking joiners before sending it, so every
//! joiner's call began before the read Postgres answers. A read that is already running is
//! never joined (it may have been answered before the call began). A joiner whose leader fails
//! or is cancelled reads on its own.

use super::{Memory, Store, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Service, error signature and window (ms): what a memory read asks.
type Key = (String, String, u128);

/// Reads still waiting for a connection, by key: who joined each. An entry is its leader's
/// alone: created by it, removed only by it (closing, or dropped before closing), so no
/// other caller can replace it meanwhile.
#[derive(Default, Clone)]
pub(super) struct Recalls {
    waiting: Arc<Mutex<HashMap<Key, Vec<oneshot::Sender<Memory>>>>>,
}

/// What a caller does: lead a read, or wait for the one it joined.
enum Role {
    Lead(Leading),
    Join(oneshot::Receiver<Memory>),
}

/// A leader's place in the table. Dropped before it closes (an error, a cancelled caller), it
/// removes its entry, so its joiners see their senders dropped and read on their own.
struct Leading {
    recalls: Recalls,
    /// `None` once closed.
    key: Option<Key>,
}

impl Leading {
    /// Stop taking joiners; who joined gets the answer.
    fn close(mut self) -> Vec<oneshot::Sender<Memory>> {
        self.key.take().map(|key| self.recalls.take(&key)).unwrap_or_default()
    }
}

impl Drop for Leading {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.recalls.take(&key);
        }
    }
}

impl Recalls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Vec<oneshot::Sender<Memory>>>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn role(&self, key: Key) -> Role {
        let mut waiting = self.lock();
        if let Some(joiners) = waiting.get_mut(&key) {
            let (tx, rx) = oneshot::channel();
            joiners.push(tx);
            return Role::Join(rx);
        }
        waiting.insert(key.clone(), Vec::new());
        Role::Lead(Leading { recalls: self.clone(), key: Some(key) })
    }

    /// Remove a leader's entry; returns its joiners.
    fn take(&self, key: &Key) -> Vec<oneshot::Sender<Memory>> {
        self.lock().remove(key).unwrap_or_default()
    }

    #[cfg(test)]
    fn waiting_keys(&self) -> usize {
        self.lock().len()
    }
}

impl Store {
    /// Episodic memory for `service` and error `signature`, as of a moment after this call
    /// began (see the module's comment: concurrent calls for one key may share a statement).
    pub async fn memory(&self, service: &str, signature: &str, window: Duration) -> Result<Memory, StoreError> {
        let key = (service.to_owned(), signature.to_owned(), window.as_millis());
        let leading = match self.recalls.role(key) {
            Role::Join(answer) => match answer.await {
                Ok(memory) => return Ok(memory),
                // The read we joined did not answer: read on our own.
                Err(_) => return self.read_memory(self.client().await?, service, signature, window).await,
            },
            Role::Lead(leading) => leading,
        };
        let client = self.client().await;
        // No await between closing and sending the query: whoever joined asked before it.
        let joiners = leading.close();
        let memory = self.read_memory(client?, service, signature, window).await?;
        for joiner in joiners {
            let _ = joiner.send(memory.clone());
        }
        Ok(memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Key {
        (s.into(), "sig".into(), 1000)
    }

    #[tokio::test]
    async fn a_second_read_joins_a_waiting_one_and_gets_its_answer() {
        let r = Recalls::default();
        let Role::Lead(lead) = r.role(key("web")) else { panic!("first read must lead") };
        let Role::Join(rx) = r.role(key("web")) else { panic!("second read must join") };
        assert!(matches!(r.role(key("db")), Role::Lead(_)), "another key leads its own read");
        let joiners = lead.close();
        assert_eq!(joiners.len(), 1);
        assert!(matches!(r.role(key("web")), Role::Lead(_)), "a read that is running is never joined");
        let m = Memory { failed: vec!["x".into()], fixes: vec![] };
        for j in joiners {
            j.send(m.clone()).unwrap();
        }
        assert_eq!(rx.await.unwrap(), m);
        // Leaders closed or dropped leave nothing behind: no entry, no handle on the table.
        assert_eq!(r.waiting_keys(), 0);
        assert_eq!(Arc::strong_count(&r.waiting), 1);
    }

    #[tokio::test]
    async fn a_failed_leader_lets_its_joiners_go_and_leaves_nothing_behind() {
        let r = Recalls::default();
        let Role::Lead(lead) = r.role(key("web")) else { panic!() };
        let Role::Join(rx) = r.role(key("web")) else { panic!() };
        drop(lead);
        assert!(rx.await.is_err(), "the joiner must learn that nobody will answer");
        assert_eq!(r.waiting_keys(), 0);
        // A closed leader's drop leaves the next leader of its key alone.
        let Role::Lead(first) = r.role(key("web")) else { panic!() };
        assert!(first.close().is_empty());
        let Role::Lead(second) = r.role(key("web")) else { panic!() };
        assert!(matches!(r.role(key("web")), Role::Join(_)), "the second leader's entry is there");
        drop(second);
        assert_eq!(r.waiting_keys(), 0);
        assert_eq!(Arc::strong_count(&r.waiting), 1);
    }
}
