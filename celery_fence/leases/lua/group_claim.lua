-- group_claim.lua: take one of a concurrency group's N slots (fence_group_limit).
-- KEYS[1..N]  slot keys "<prefix>:{g<digest(group)>}:slot:<i>", one hash tag: one Cluster slot.
--             Each a lease like a key's: value "<token>:<i>" with a PX expiry, renewed by
--             renew.lua and released by release.lua (compare-and-delete), so a killed worker's
--             slot frees itself one TTL after its last renewal.
-- ARGV[1]     owner token (unique per attempt)
-- ARGV[2]     slot TTL in milliseconds
-- Returns {1, i} when slot i (1-based) was taken,
--         {0, soonest_ms} when every slot is held (soonest_ms: the soonest expiry among them;
--         -1 when one has no expiry).
local soonest = nil
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i], ARGV[1] .. ':' .. i, 'NX', 'PX', ARGV[2]) then
    return {1, i}
  end
  local pttl = redis.call('PTTL', KEYS[i])
  if soonest == nil or (pttl >= 0 and (soonest < 0 or pttl < soonest)) then
    soonest = pttl
  end
end
return {0, soonest or -1}
