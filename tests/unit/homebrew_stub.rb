# Loads a formula against a minimal stand-in for Homebrew's DSL and prints what it declared as JSON,
# so a test can check that the formula evaluates (not just parses) without Homebrew installed.
# Usage: ruby homebrew_stub.rb Formula/kapitsa.rb
require "json"

module Language
  module Python
    module Virtualenv; end
  end
end

class Formula
  FIELDS = %i[desc homepage url sha256 license].freeze

  class << self
    attr_reader :declared

    def inherited(subclass)
      super
      subclass.instance_variable_set(:@declared, { "depends_on" => [], "resources" => [] })
    end

    FIELDS.each do |field|
      define_method(field) { |value| @declared[field.to_s] = value }
    end

    def depends_on(spec)
      @declared["depends_on"] << (spec.is_a?(Hash) ? spec.map { |k, v| "#{k}=>#{v}" }.join : spec.to_s)
    end

    def pypi_packages(exclude_packages: [])
      @declared["pypi_exclude"] = exclude_packages
    end

    def resource(name, &block)
      stanza = ResourceStanza.new
      stanza.instance_eval(&block)
      @declared["resources"] << { "name" => name, "url" => stanza.url_value, "sha256" => stanza.sha256_value }
    end

    def test(&block)
      @declared["test"] = !block.nil?
    end
  end

  # Records the install method's definition; Homebrew calls it, we only check it exists.
  def self.method_added(name)
    @declared["methods"] = (@declared["methods"] || []) << name.to_s if @declared
  end
end

class ResourceStanza
  attr_reader :url_value, :sha256_value

  def url(value) = @url_value = value
  def sha256(value) = @sha256_value = value
end

load ARGV.fetch(0)
formula = Formula.subclasses.fetch(0)
puts JSON.generate({ "class" => formula.name }.merge(formula.declared))
