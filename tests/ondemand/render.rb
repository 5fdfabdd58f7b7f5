# Render one of the Open OnDemand app's ERB templates the way OnDemand does, for the tests.
#
#   ruby render.rb TEMPLATE VALUES.json   prints the rendered text
#
# Each top-level key of VALUES becomes a method the template can call, and a key whose value is an
# object becomes an object with one method per key. That mirrors OnDemand: submit.yml.erb calls
# form attributes directly (`num_gpus`), template/*.erb reach them through `context.num_gpus`, and
# view.html.erb calls `host`, `port`, `password`. A name the template uses but VALUES lacks fails
# with NameError, as it would in OnDemand.
require "erb"
require "json"

def scope_for(values)
  scope = Object.new
  values.each do |name, value|
    value = scope_for(value) if value.is_a?(Hash)
    scope.define_singleton_method(name) { value }
  end
  scope
end

template, values = ARGV
scope = scope_for(JSON.parse(File.read(values)))
erb = ERB.new(File.read(template), trim_mode: "-")
erb.filename = template
print erb.result(scope.instance_eval { binding })
