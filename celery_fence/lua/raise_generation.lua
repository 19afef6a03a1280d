-- raise_generation.lua: set-if-greater on the generation counter.
-- Used when Redis lost its counter (restart, failover) and handed out a generation the SQL store
-- had already registered: the counter is raised to the store's value so the next claim exceeds it.
-- KEYS[1]  generation key
-- ARGV[1]  floor: the highest generation the store has registered
-- Returns the counter's value after the call.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if current < floor then
  redis.call('SET', KEYS[1], floor)
  return floor
end
return current
