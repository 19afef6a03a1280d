-- claim_in_group.lua: claim.lua and group_claim.lua in one round trip (single Redis only: the
-- key's lease and the group's slots carry different hash tags). The key's lease is checked
-- first, so a busy key takes no slot; then a free slot of the group; then the generation.
-- KEYS[1]      lease key       "<prefix>:{<tag>}:lease"   value "<token>:<generation>"
-- KEYS[2]      generation key  "<prefix>:{<tag>}:gen"
-- KEYS[3..N+2] the group's N slot keys "<prefix>:{g<digest(group)>}:slot:<i>", each a lease
--              like a key's: value "<slot token>:<i>" with a PX expiry
-- ARGV[1]      owner token (unique per attempt)
-- ARGV[2]      lease and slot TTL in milliseconds
-- ARGV[3]      generation counter lifetime in milliseconds after this claim (0: forever)
-- ARGV[4]      N
-- ARGV[5]      the slot's owner token ("<token>/slot")
-- KEYS[N+3..], ARGV[6..] (optional): leases of this process's finished attempts (slots or
--              keys) and their expected values, released first (compare-and-delete each, an
--              expected "<token>:" matching that attempt's lease whatever its suffix).
-- Returns {1, generation, i}   the key claimed with slot i (1-based),
--         {0, remaining_ms, 0} the key's lease is live (busy; -1: it has no expiry),
--         {2, soonest_ms, 0}   every slot is held (soonest_ms: the soonest expiry among
--                              them; -1 when one has no expiry); nothing was taken.
local n = tonumber(ARGV[4])
for i = n + 3, #KEYS do
  local value = redis.call('GET', KEYS[i])
  local expected = ARGV[i - n + 3]
  if value and (value == expected
      or (string.sub(expected, -1) == ':' and string.sub(value, 1, #expected) == expected)) then
    redis.call('DEL', KEYS[i])
  end
end
local remaining = redis.call('PTTL', KEYS[1])
if remaining ~= -2 then
  return {0, remaining, 0}
end
local slot = nil
local soonest = nil
for i = 1, n do
  if redis.call('SET', KEYS[i + 2], ARGV[5] .. ':' .. i, 'NX', 'PX', ARGV[2]) then
    slot = i
    break
  end
  local pttl = redis.call('PTTL', KEYS[i + 2])
  if soonest == nil or (pttl >= 0 and (soonest < 0 or pttl < soonest)) then
    soonest = pttl
  end
end
if slot == nil then
  return {2, soonest or -1, 0}
end
local generation = redis.call('INCR', KEYS[2])
if tonumber(ARGV[3]) > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. generation, 'PX', ARGV[2])
return {1, generation, slot}
