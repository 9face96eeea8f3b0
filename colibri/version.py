"""The package version, in a module of its own: submodules read it without importing the
package (whose __init__ imports them)."""
__version__ = "0.1.0"
