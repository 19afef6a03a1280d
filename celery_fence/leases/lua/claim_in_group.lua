-- claim_in_group.lua: claim.lua and group_claim.lua in one round trip. Single Redis only: the
-- key's lease and the group's slots carry different hash tags, and the slot keys are built
-- here from their base name (keys a script does not declare, which a Cluster refuses) so a
-- group of 1000 slots does not send 1000 key names a claim. The key's lease is checked first,
-- so a busy key takes no slot; then a free slot of the group; then the generation.
-- KEYS[1]   lease key       "<prefix>:{<tag>}:lease"   value "<token>:<generation>"
-- KEYS[2]   generation key  "<prefix>:{<tag>}:gen"
-- KEYS[3..], ARGV[8..] (optional): leases of this process's finished attempts (slots or keys)
--           and their expected values, released first (compare-and-delete each, an expected
--           "<token>:" matching that attempt's lease whatever its suffix).
-- ARGV[1]   owner token (unique per attempt)
-- ARGV[2]   lease and slot TTL in milliseconds
-- ARGV[3]   generation counter lifetime in milliseconds after this claim (0: forever)
-- ARGV[4]   N, the group's limit
-- ARGV[5]   the slot's owner token ("<token>/slot")
-- ARGV[6]   the slots' base name "<prefix>:{g<digest(group)>}:slot": slot i is "<base>:<i>",
--           each a lease like a key's, value "<slot token>:<i>" with a PX expiry
-- ARGV[7]   where to start looking, 0..N-1 (the caller's random pick: a free slot is found at
--           the first try while few are held, whatever N)
-- Returns {1, generation, i}   the key claimed with slot i (1-based),
--         {0, remaining_ms, 0} the key's lease is live (busy; -1: it has no expiry),
--         {2, soonest_ms, 0}   every slot is held (soonest_ms: the soonest expiry among
--                              them; -1 when one has no expiry); nothing was taken.
-- include: _claim_parts
local n = tonumber(ARGV[4])
release_finished(5)
local remaining = redis.call('PTTL', KEYS[1])
if remaining ~= -2 then
  return {0, remaining, 0}
end
local slot = nil
local start = tonumber(ARGV[7])
for j = 0, n - 1 do
  local i = (start + j) % n + 1
  if redis.call('SET', ARGV[6] .. ':' .. i, ARGV[5] .. ':' .. i, 'NX', 'PX', ARGV[2]) then
    slot = i
    break
  end
end
if slot == nil then
  local soonest = nil
  for i = 1, n do
    local pttl = redis.call('PTTL', ARGV[6] .. ':' .. i)
    if soonest == nil or (pttl >= 0 and (soonest < 0 or pttl < soonest)) then
      soonest = pttl
    end
  end
  return {2, soonest or -1, 0}
end
return {1, take_generation(), slot}
