//! Identifiers and addresses (`effect/src/cluster/Envelope.ts`).
//!
//! Strings that are cloned along every message path (`ShardGroup`, `EntityType`, `EntityId`,
//! hosts) are shared `Arc<str>`, so cloning an address never allocates; names written in code
//! (an entity type's `TYPE`, the default group) are `'static` strings, which clone without
//! touching a reference count.

use std::cmp::Ordering;
use std::fmt::{self, Write as _};
use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::Arc;

use crate::error::ParseError;

/// The text of a name: a `'static` string (a type name from code, the default group), which
/// clones and drops without touching a reference count, or a shared one.
#[derive(Clone)]
enum SharedStr {
    Static(&'static str),
    Shared(Arc<str>),
}

impl SharedStr {
    fn as_str(&self) -> &str {
        match self {
            SharedStr::Static(name) => name,
            SharedStr::Shared(name) => name,
        }
    }
}

// Compared, ordered and hashed by their text, whichever form they are in.
impl PartialEq for SharedStr {
    fn eq(&self, other: &SharedStr) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for SharedStr {}

impl PartialOrd for SharedStr {
    fn partial_cmp(&self, other: &SharedStr) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SharedStr {
    fn cmp(&self, other: &SharedStr) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for SharedStr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

macro_rules! shared_str_newtype {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(SharedStr);

        impl $name {
            /// The name as a string slice.
            pub fn as_str(&self) -> &str {
                self.0.as_str()
            }

            /// The name `name`, which clones without a reference count (names written in
            /// code: an entity type's `TYPE`, a group's name).
            pub const fn from_static(name: &'static str) -> $name {
                $name(SharedStr::Static(name))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self.as_str(), f)
            }
        }

        impl From<&str> for $name {
            fn from(value: &str) -> $name {
                $name(SharedStr::Shared(Arc::from(value)))
            }
        }

        impl From<String> for $name {
            fn from(value: String) -> $name {
                $name(SharedStr::Shared(Arc::from(value)))
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                self.as_str()
            }
        }
    };
}

shared_str_newtype!(
    /// The name of a shard group, such as `default`.
    ///
    /// Every group has `shards_per_group` shards; a runner serves the groups it is assigned.
    ShardGroup
);

shared_str_newtype!(
    /// The name of an entity type, such as `Counter` or `Workflow/checkout`.
    EntityType
);

shared_str_newtype!(
    /// The key of one entity instance within its type.
    EntityId
);

macro_rules! plain_display {
    ($($name:ident),*) => {$(
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}

plain_display!(ShardGroup, EntityType, Tag);

/// An entity id as text, with its control characters escaped (an escape character shows as
/// `\u{1b}`, a line feed as `\n`): ids come from outside (an HTTP path, a peer, a stored
/// message), and every log line and span field shows them through this `Display`, so that an id
/// can never forge a log line or drive a terminal.
/// Every other character is shown as is. The id itself is [`EntityId::as_str`]: storage keys,
/// hashes and wire forms use that, never this text.
///
/// Escaping here rather than refusing such ids where they are made: an id is made from a
/// `String` in many places (`From` cannot fail), and ids stored by the reference, or sent by
/// its runners, must still be read and served as they are.
impl fmt::Display for EntityId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.as_str();
        if !text.chars().any(char::is_control) {
            return f.write_str(text);
        }
        for character in text.chars() {
            if character.is_control() {
                write!(f, "{}", character.escape_debug())?;
            } else {
                f.write_char(character)?;
            }
        }
        Ok(())
    }
}

shared_str_newtype!(
    /// The tag of an RPC, such as `Increment`: which request of its entity type a message is.
    Tag
);

impl std::ops::Deref for Tag {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl ShardGroup {
    /// The group every entity, singleton and runner uses unless told otherwise.
    pub fn default_group() -> ShardGroup {
        ShardGroup::from_static("default")
    }
}

/// One shard: a group and a number in `1..=shards_per_group`.
///
/// Its string form is `group:id`, for example `default:7`. Groups may contain `:`; the string
/// form is split at the last one.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardId {
    group: ShardGroup,
    id: u32,
}

impl ShardId {
    /// The shard `id` of `group`.
    pub fn new(group: ShardGroup, id: u32) -> ShardId {
        ShardId { group, id }
    }

    /// The shard's group.
    pub fn group(&self) -> &ShardGroup {
        &self.group
    }

    /// The shard's number within its group, starting at 1.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.group, self.id)
    }
}

impl fmt::Debug for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShardId({self})")
    }
}

impl FromStr for ShardId {
    type Err = ParseError;

    fn from_str(input: &str) -> Result<ShardId, ParseError> {
        let Some((group, id)) = input.rsplit_once(':') else {
            return Err(ParseError::new("shard id", input, "expected `group:id`"));
        };
        let id: u32 = id.parse().map_err(|_| {
            ParseError::new("shard id", input, "the id after the last `:` must be a number")
        })?;
        if id == 0 {
            return Err(ParseError::new("shard id", input, "shard numbers start at 1"));
        }
        Ok(ShardId::new(ShardGroup::from(group), id))
    }
}

/// The address of one entity instance: its shard, type and id.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntityAddress {
    /// The shard the entity id hashes to.
    pub shard_id: ShardId,
    /// The entity's type.
    pub entity_type: EntityType,
    /// The entity's id within its type.
    pub entity_id: EntityId,
}

impl fmt::Display for EntityAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} (shard {})", self.entity_type, self.entity_id, self.shard_id)
    }
}

impl fmt::Debug for EntityAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EntityAddress({self})")
    }
}

/// Where a runner can be reached: `host:port`.
///
/// The string form is also the runner's key in the registry and in the hash ring. It is split
/// at the last `:`, so an IPv6 host is written without brackets (`::1:34431`), as the reference
/// does.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunnerAddress {
    host: Arc<str>,
    port: u16,
}

impl RunnerAddress {
    /// The runner at `host` and `port`.
    pub fn new(host: impl Into<Arc<str>>, port: u16) -> RunnerAddress {
        RunnerAddress { host: host.into(), port }
    }

    /// The host name or IP address.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl fmt::Display for RunnerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

impl fmt::Debug for RunnerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunnerAddress({self})")
    }
}

impl FromStr for RunnerAddress {
    type Err = ParseError;

    fn from_str(input: &str) -> Result<RunnerAddress, ParseError> {
        let Some((host, port)) = input.rsplit_once(':') else {
            return Err(ParseError::new("runner address", input, "expected `host:port`"));
        };
        if host.is_empty() {
            return Err(ParseError::new("runner address", input, "the host is empty"));
        }
        let port = port
            .parse()
            .map_err(|_| ParseError::new("runner address", input, "the port must be 0..=65535"))?;
        Ok(RunnerAddress::new(host, port))
    }
}

/// A runner's relative share of the shards: a finite number, 1 by default.
///
/// The hash ring clamps it to at least 0.1 (see [`HashRing`](crate::HashRing)).
#[derive(Clone, Copy, Debug)]
pub struct RunnerWeight(f64);

impl RunnerWeight {
    /// The default weight.
    pub const ONE: RunnerWeight = RunnerWeight(1.0);

    /// `weight`, if it is finite.
    pub fn new(weight: f64) -> Option<RunnerWeight> {
        // -0.0 and 0.0 are one weight, so that equality and hashing agree.
        weight.is_finite().then_some(RunnerWeight(if weight == 0.0 { 0.0 } else { weight }))
    }

    /// The weight as a number.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl PartialEq for RunnerWeight {
    fn eq(&self, other: &RunnerWeight) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for RunnerWeight {}

impl Hash for RunnerWeight {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

impl PartialOrd for RunnerWeight {
    fn partial_cmp(&self, other: &RunnerWeight) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RunnerWeight {
    fn cmp(&self, other: &RunnerWeight) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl fmt::Display for RunnerWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A runner as recorded in the registry: its address, the shard groups it serves and its weight.
///
/// Equality, ordering and hashing use the address and the weight only, as in the reference: a
/// runner that changes its groups without changing address or weight is the same runner (a
/// weight change is a departure plus a join).
#[derive(Clone, Debug)]
pub struct Runner {
    /// Where the runner is reached.
    pub address: RunnerAddress,
    /// The shard groups the runner serves.
    pub groups: Vec<ShardGroup>,
    /// The runner's relative share of shards.
    pub weight: RunnerWeight,
}

impl Runner {
    /// The runner at `address` serving `groups` with `weight`.
    pub fn new(address: RunnerAddress, groups: Vec<ShardGroup>, weight: RunnerWeight) -> Runner {
        Runner { address, groups, weight }
    }
}

impl PartialEq for Runner {
    fn eq(&self, other: &Runner) -> bool {
        self.address == other.address && self.weight == other.weight
    }
}

impl Eq for Runner {}

impl Hash for Runner {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.address.hash(state);
        self.weight.hash(state);
    }
}

impl PartialOrd for Runner {
    fn partial_cmp(&self, other: &Runner) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Runner {
    fn cmp(&self, other: &Runner) -> Ordering {
        self.address.cmp(&other.address).then_with(|| self.weight.cmp(&other.weight))
    }
}

/// The address of a singleton: its name and the shard the name hashes to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SingletonAddress {
    /// The shard that decides which runner runs the singleton.
    pub shard_id: ShardId,
    /// The singleton's name.
    pub name: Arc<str>,
}

/// The id the runner registry gives a runner; snowflakes use it modulo 1024.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MachineId(i32);

impl MachineId {
    /// The machine id `id`.
    pub const fn new(id: i32) -> MachineId {
        MachineId(id)
    }

    /// The id as stored in the registry.
    pub const fn get(self) -> i32 {
        self.0
    }

    /// The 10 bits a snowflake carries: the id modulo 1024.
    pub fn snowflake_bits(self) -> u16 {
        // rem_euclid keeps it in 0..1024 even for a negative id.
        u16::try_from(self.0.rem_euclid(1024)).unwrap_or(0)
    }
}

impl fmt::Display for MachineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MachineId({})", self.0)
    }
}

#[cfg(test)]
mod tests;
