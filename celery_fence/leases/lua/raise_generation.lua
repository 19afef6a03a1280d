-- raise_generation.lua: set-if-greater on the generation counter.
-- Used when Redis lost its counter (restart, failover) and handed out a generation the SQL store
-- had already registered: the counter is raised to the store's value so the next claim exceeds it.
-- KEYS[1]  generation key
-- ARGV[1]  floor: the highest generation the store has registered
-- ARGV[2]  (optional) counter lifetime in milliseconds when it is raised (0 or absent: none)
-- Returns the counter's value after the call.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if current < floor then
  local ttl = tonumber(ARGV[2] or '0')
  if ttl > 0 then
    redis.call('SET', KEYS[1], floor, 'PX', ttl)
  else
    redis.call('SET', KEYS[1], floor)
  end
  return floor
end
return current
