-- group_claim.lua: take one of a concurrency group's N slots (fence_group_limit).
-- KEYS[1..N]  slot keys "<prefix>:{g<digest(group)>}:slot:<i>", one hash tag: one Cluster slot.
--             Each a lease like a key's: value "<token>:<i>" with a PX expiry, renewed by
--             renew.lua and released by release.lua (compare-and-delete), so a killed worker's
--             slot frees itself one TTL after its last renewal.
-- ARGV[1]     owner token (unique per attempt)
-- ARGV[2]     slot TTL in milliseconds
-- ARGV[3]     N
-- KEYS[N+1..], ARGV[4..] (optional, single Redis only): leases of this process's finished
--             attempts (slots or keys) and their expected values, released first
--             (compare-and-delete each), so a release rides in this round trip, as in claim.lua.
-- Returns {1, i} when slot i (1-based) was taken,
--         {0, soonest_ms} when every slot is held (soonest_ms: the soonest expiry among them;
--         -1 when one has no expiry).
local n = tonumber(ARGV[3])
for i = n + 1, #KEYS do
  local value = redis.call('GET', KEYS[i])
  local expected = ARGV[i - n + 3]
  if value and (value == expected
      or (string.sub(expected, -1) == ':' and string.sub(value, 1, #expected) == expected)) then
    redis.call('DEL', KEYS[i])
  end
end
local soonest = nil
for i = 1, n do
  if redis.call('SET', KEYS[i], ARGV[1] .. ':' .. i, 'NX', 'PX', ARGV[2]) then
    return {1, i}
  end
  local pttl = redis.call('PTTL', KEYS[i])
  if soonest == nil or (pttl >= 0 and (soonest < 0 or pttl < soonest)) then
    soonest = pttl
  end
end
return {0, soonest or -1}
