-- claim.lua: take the lease for one logical key, with a new generation.
-- KEYS[1]  lease key       "<prefix>:{<tag>}:lease"  value "<token>:<generation>"
-- KEYS[2]  generation key  "<prefix>:{<tag>}:gen"    an integer counter, only ever INCRed or raised
-- ARGV[1]  owner token (random, unique per attempt)
-- ARGV[2]  lease TTL in milliseconds
-- ARGV[3]  generation counter lifetime in milliseconds after this claim (0: never expires). The
--          SQL store is the authority on generations: a counter that expired and comes back
--          lower than a stored generation is raised by raise_generation.lua, so expiring it is
--          safe, and keeps Redis from holding one counter for every key ever claimed.
-- KEYS[3..n], ARGV[4..n+1] (optional, single Redis only): lease keys of this process's
--          finished attempts and their expected values, released first (compare-and-delete
--          each), so a release rides in the claim's round trip. A Redis Cluster sends them
--          separately. An expected value "<token>:" (no generation) matches that attempt's lease
--          whatever its generation: the release of a claim whose reply was lost.
-- Returns {1, generation} when claimed,
--         {0, remaining_ms} when a live lease exists (busy; -1 means it has no expiry).
-- include: _claim_parts
release_finished(1)
local remaining = redis.call('PTTL', KEYS[1])
if remaining ~= -2 then
  return {0, remaining}
end
return {1, take_generation()}
