//! Tests of `lock`.

use cluster_core::ShardGroup;

use super::*;

#[test]
fn keys_match_the_reference() {
    assert_eq!(advisory_namespace(&TablePrefix::default()), -1_455_371_005);
    let options = SqlStorageOptions {
        available_groups: vec![ShardGroup::from("default"), ShardGroup::from("special")],
        ..SqlStorageOptions::default()
    };
    let shard = |group: &str, id| ShardId::new(ShardGroup::from(group), id);
    assert_eq!(advisory_lock_number(&options, &shard("default", 7)).unwrap(), 1_000_007);
    assert_eq!(advisory_lock_number(&options, &shard("special", 300)).unwrap(), 2_000_300);
    assert_eq!(
        advisory_lock_number(&options, &shard("other", 1)).unwrap_err().kind(),
        StorageErrorKind::InvalidInput
    );
    assert_eq!(mysql_lock_name(&TablePrefix::default(), &shard("default", 7)), "cluster.default:7");
}
