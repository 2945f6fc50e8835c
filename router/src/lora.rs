//! LoRA adapters the router serves next to the base model: the registry of names, the ids the shards
//! know them by, and the lifetime of each.
//!
//! The router gives every adapter an id (from a counter: >= 1, never reused, so a name loaded again is a
//! new adapter to the shards and to the prefix cache) and tells every shard to load it under that id
//! (`LoadAdapter`); a sequence then names the id (`SequenceChunk.adapter_id`). An adapter's life:
//!
//! ```text
//!   reserve(name) ──▶ loading ──complete──▶ ready ──unload──▶ draining ──last request ends──▶ unloaded
//!                        └──cancel (the shards refused)        │ (no request holds it)       (its id goes
//!                                                              └───────────────────────────▶  to the shards
//!                                                                                             once)
//! ```
//!
//! Only a ready adapter has a name: requests resolve names while it is ready, and an unloaded name is free
//! at once (new requests get 404; the name may be loaded again, under a new id). A request holds an
//! `AdapterRef` from the moment its name resolved until it is dropped everywhere (the engine drops its
//! sequence after the release that tells the shards to forget it), so an adapter drains while requests
//! use it, and its id reaches the shards (`ForwardRequest.unloaded_adapter_ids`) only once no sequence of
//! that call or a later one can name it.
//!
//! `LoraRegistry` is the plain data (tested alone); `Adapters` shares it between the HTTP handlers and the
//! engine task behind a mutex held only for a map operation. The calls to the shards are their callers'
//! (`http::lora` loads, the engine loads again after a shard restart): this module does no I/O.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LoraError {
    #[error("The lora adapter `{0}` has already been loaded.")]
    Duplicate(String),
    #[error("The lora adapter `{0}` cannot be found.")]
    Unknown(String),
    #[error("`lora_name` must be a non-empty name other than the base model's (`{0}`)")]
    InvalidName(String),
}

/// A ready (or draining) adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    pub id: u32,
    pub name: Arc<str>,
    /// The PEFT folder it was loaded from, as the shards read it.
    pub path: String,
    /// Its LoRA rank and the module names it modifies, as the shards reported.
    pub rank: u32,
    pub target_modules: Vec<String>,
    /// Unix time it was loaded, in seconds (`/v1/models`' `created`).
    pub created: u64,
}

struct Entry {
    info: AdapterInfo,
    /// Requests holding an `AdapterRef` to it.
    num_refs: usize,
    /// Unloaded: its name is free; it goes once `num_refs` reaches 0.
    is_draining: bool,
}

/// Names, ids and reference counts of the adapters. Plain data: no I/O, no clock.
#[derive(Default)]
pub struct LoraRegistry {
    /// The last id given (ids start at 1; 0 is the base model).
    last_id: u32,
    /// Names of ready adapters.
    ids: HashMap<Arc<str>, u32>,
    /// Names reserved by loads still in progress.
    loading: HashSet<String>,
    /// Ready and draining adapters, by id.
    entries: BTreeMap<u32, Entry>,
    /// Ids of drained adapters not yet sent to the shards.
    unloaded: Vec<u32>,
}

impl LoraRegistry {
    /// Reserves `name` for a load and gives it a new id; fails if the name is taken or still loading.
    pub fn reserve(&mut self, name: &str) -> Result<u32, LoraError> {
        if self.ids.contains_key(name) || self.loading.contains(name) {
            return Err(LoraError::Duplicate(name.into()));
        }
        self.loading.insert(name.into());
        self.last_id += 1;
        Ok(self.last_id)
    }

    /// The shards loaded the reserved adapter: requests may name it from now on.
    pub fn complete(&mut self, info: AdapterInfo) {
        let was_reserved = self.loading.remove(&*info.name);
        assert!(was_reserved, "complete follows reserve");
        self.ids.insert(info.name.clone(), info.id);
        let entry = Entry {
            info,
            num_refs: 0,
            is_draining: false,
        };
        self.entries.insert(entry.info.id, entry);
    }

    /// The load of a reserved name failed: the name is free again (its id stays unused).
    pub fn cancel(&mut self, name: &str) {
        self.loading.remove(name);
    }

    /// A reference to ready adapter `name` for a request, or None when no ready adapter has that name.
    pub fn acquire(&mut self, name: &str) -> Option<(u32, Arc<str>)> {
        let id = *self.ids.get(name)?;
        let entry = self.entries.get_mut(&id).expect("named adapters have entries");
        entry.num_refs += 1;
        Some((id, entry.info.name.clone()))
    }

    /// One more reference to an adapter a request already holds (a copy of its reference).
    fn acquire_id(&mut self, id: u32) {
        self.entries.get_mut(&id).expect("a held adapter has an entry").num_refs += 1;
    }

    /// A request let go of adapter `id`; the last one to let go of a draining adapter unloads it.
    pub fn release(&mut self, id: u32) {
        let entry = self.entries.get_mut(&id).expect("a held adapter has an entry");
        entry.num_refs -= 1;
        if entry.num_refs == 0 && entry.is_draining {
            self.entries.remove(&id);
            self.unloaded.push(id);
        }
    }

    /// Unloads ready adapter `name`: the name is free at once; the adapter drains while requests hold it.
    pub fn unload(&mut self, name: &str) -> Result<(), LoraError> {
        let id = self.ids.remove(name).ok_or_else(|| LoraError::Unknown(name.into()))?;
        let entry = self.entries.get_mut(&id).expect("named adapters have entries");
        if entry.num_refs == 0 {
            self.entries.remove(&id);
            self.unloaded.push(id);
        } else {
            entry.is_draining = true;
        }
        Ok(())
    }

    /// The ids of adapters drained since the last call, for the shards to free (each returned once).
    pub fn take_unloaded(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.unloaded)
    }

    /// The ready adapters, in load order.
    pub fn ready(&self) -> Vec<AdapterInfo> {
        self.entries
            .values()
            .filter(|entry| !entry.is_draining)
            .map(|entry| entry.info.clone())
            .collect()
    }

    /// Every adapter the shards must hold: ready and draining ones. The shards hold exactly these (after a
    /// restart, once they are loaded again), so no id waits to be unloaded any more.
    pub fn take_loaded(&mut self) -> Vec<AdapterInfo> {
        self.unloaded.clear();
        self.entries.values().map(|entry| entry.info.clone()).collect()
    }

    /// Adapters still held by requests after they were unloaded.
    pub fn num_draining(&self) -> usize {
        self.entries.values().filter(|entry| entry.is_draining).count()
    }
}

/// A request's hold on an adapter: while any copy lives, the adapter stays loaded on the shards.
pub struct AdapterRef {
    pub id: u32,
    pub name: Arc<str>,
    registry: Arc<Mutex<LoraRegistry>>,
}

impl Clone for AdapterRef {
    fn clone(&self) -> Self {
        lock(&self.registry).acquire_id(self.id);
        Self {
            id: self.id,
            name: self.name.clone(),
            registry: self.registry.clone(),
        }
    }
}

impl Drop for AdapterRef {
    fn drop(&mut self) {
        lock(&self.registry).release(self.id);
    }
}

impl std::fmt::Debug for AdapterRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdapterRef({}: {})", self.id, self.name)
    }
}

fn lock(registry: &Mutex<LoraRegistry>) -> std::sync::MutexGuard<'_, LoraRegistry> {
    registry
        .lock()
        .expect("the registry's methods do not panic while it is locked")
}

/// The adapters, shared by the HTTP handlers (names, loads, unloads) and the engine (unloaded ids).
#[derive(Clone)]
pub struct Adapters {
    registry: Arc<Mutex<LoraRegistry>>,
    /// The shards' LoRA slots: the most distinct adapters one forward call may use (0: LoRA is off).
    pub max_loras: u32,
    /// The largest rank the shards accept.
    pub max_lora_rank: u32,
}

impl Adapters {
    /// No adapter yet, on shards with `max_loras` slots (0: LoRA is off) for ranks up to `max_lora_rank`.
    pub fn new(max_loras: u32, max_lora_rank: u32) -> Self {
        Self {
            registry: Arc::default(),
            max_loras,
            max_lora_rank,
        }
    }

    /// A reference to ready adapter `name` for a request; None when no ready adapter has that name.
    pub fn resolve(&self, name: &str) -> Option<AdapterRef> {
        let (id, name) = lock(&self.registry).acquire(name)?;
        Some(AdapterRef {
            id,
            name,
            registry: self.registry.clone(),
        })
    }

    /// Reserves `name` for a load (see `LoraRegistry::reserve`) and gives its id; `base_name` (the served
    /// model's name) is not available as an adapter name.
    pub fn reserve(&self, name: &str, base_name: &str) -> Result<u32, LoraError> {
        if name.is_empty() || name == base_name {
            return Err(LoraError::InvalidName(base_name.into()));
        }
        lock(&self.registry).reserve(name)
    }

    /// The shards loaded a reserved adapter: requests may name it from now on.
    pub fn complete(&self, info: AdapterInfo) {
        lock(&self.registry).complete(info);
    }

    /// The load of reserved `name` failed: the name is free again.
    pub fn cancel(&self, name: &str) {
        lock(&self.registry).cancel(name);
    }

    /// Unloads adapter `name` (see `LoraRegistry::unload`).
    pub fn unload(&self, name: &str) -> Result<(), LoraError> {
        lock(&self.registry).unload(name)
    }

    /// The ids of adapters drained since the last call (for the next forward call), each once.
    pub fn take_unloaded(&self) -> Vec<u32> {
        lock(&self.registry).take_unloaded()
    }

    /// The ready adapters, in load order.
    pub fn ready(&self) -> Vec<AdapterInfo> {
        lock(&self.registry).ready()
    }

    /// See `LoraRegistry::take_loaded`.
    pub fn take_loaded(&self) -> Vec<AdapterInfo> {
        lock(&self.registry).take_loaded()
    }
}

/// Parses `--lora-adapters`' items, `name=path`.
pub fn parse_adapter_arg(item: &str) -> Result<(String, PathBuf), String> {
    match item.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok((name.into(), PathBuf::from(path))),
        _ => Err(format!("expected name=path, got {item:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: u32, name: &str) -> AdapterInfo {
        AdapterInfo {
            id,
            name: name.into(),
            path: format!("/adapters/{name}"),
            rank: 8,
            target_modules: vec!["q_proj".into()],
            created: 0,
        }
    }

    fn loaded(registry: &mut LoraRegistry, name: &str) -> u32 {
        let id = registry.reserve(name).unwrap();
        registry.complete(info(id, name));
        id
    }

    #[test]
    fn ids_count_up_from_one_and_are_never_reused() {
        let mut registry = LoraRegistry::default();
        assert_eq!(loaded(&mut registry, "a"), 1);
        assert_eq!(loaded(&mut registry, "b"), 2);
        let failed = registry.reserve("c").unwrap();
        registry.cancel("c");
        assert_eq!(failed, 3);
        registry.unload("a").unwrap();
        assert_eq!(loaded(&mut registry, "a"), 4, "a name loaded again is a new adapter");
        assert_eq!(loaded(&mut registry, "c"), 5);
        let names: Vec<_> = registry.ready().iter().map(|a| (a.id, a.name.to_string())).collect();
        assert_eq!(names, [(2, "b".into()), (4, "a".into()), (5, "c".into())]);
    }

    #[test]
    fn a_name_is_taken_while_loading_or_ready() {
        let mut registry = LoraRegistry::default();
        registry.reserve("a").unwrap();
        assert_eq!(registry.reserve("a"), Err(LoraError::Duplicate("a".into())));
        assert_eq!(registry.acquire("a"), None, "not ready while loading");
        registry.complete(info(1, "a"));
        assert_eq!(registry.reserve("a"), Err(LoraError::Duplicate("a".into())));
        assert_eq!(registry.unload("b"), Err(LoraError::Unknown("b".into())));
    }

    #[test]
    fn an_idle_adapter_unloads_at_once_and_its_id_goes_out_once() {
        let mut registry = LoraRegistry::default();
        let id = loaded(&mut registry, "a");
        registry.unload("a").unwrap();
        assert_eq!(registry.unload("a"), Err(LoraError::Unknown("a".into())));
        assert_eq!(registry.take_unloaded(), [id]);
        assert!(registry.take_unloaded().is_empty());
        assert!(registry.ready().is_empty());
    }

    #[test]
    fn a_used_adapter_drains_until_its_last_request_ends() {
        let mut registry = LoraRegistry::default();
        let id = loaded(&mut registry, "a");
        let (held, _) = registry.acquire("a").unwrap();
        registry.acquire("a").unwrap();
        registry.unload("a").unwrap();
        assert_eq!(registry.acquire("a"), None, "new requests no longer find it");
        assert!(registry.ready().is_empty());
        assert_eq!(registry.num_draining(), 1);
        let again = loaded(&mut registry, "a");
        assert_ne!(again, id, "the name is free at once, for a new adapter");
        registry.release(held);
        assert!(registry.take_unloaded().is_empty(), "one request still runs");
        registry.release(held);
        assert_eq!(registry.take_unloaded(), [id]);
        assert_eq!(registry.num_draining(), 0);
        assert!(registry.take_unloaded().is_empty());
    }

    #[test]
    fn references_count_their_copies() {
        let adapters = Adapters::new(2, 16);
        let id = {
            let mut registry = lock(&adapters.registry);
            loaded(&mut registry, "a")
        };
        let first = adapters.resolve("a").unwrap();
        let copy = first.clone();
        assert!(adapters.resolve("b").is_none());
        adapters.unload("a").unwrap();
        drop(first);
        assert!(adapters.take_unloaded().is_empty(), "the copy still holds it");
        drop(copy);
        assert_eq!(adapters.take_unloaded(), [id]);
    }

    #[test]
    fn adapter_args_are_name_equals_path() {
        assert_eq!(parse_adapter_arg("sql=/a/b"), Ok(("sql".into(), PathBuf::from("/a/b"))));
        assert_eq!(parse_adapter_arg("x=a=b"), Ok(("x".into(), PathBuf::from("a=b"))));
        for bad in ["sql", "=/a", "sql="] {
            assert!(parse_adapter_arg(bad).is_err(), "{bad}");
        }
    }
}
